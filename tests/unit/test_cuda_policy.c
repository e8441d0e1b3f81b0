/* The policy kernels (templates/kvq_policy.cuh) under the SIMT emulator against the host functions they replace,
 * on random and structured inputs, ties, special values (NaN, -0, +-inf) and edge sizes (n = 1, k = 0, k >= n,
 * more items than a block has threads). Every decision must be identical, and every intermediate the host also
 * computes (saliencies, probe rows, pool state, mean-replaced rows) bit-identical:
 *   - selection (kvq_zip_select) against kvq_select_salient;
 *   - TailorKV: kvq_tk_absmax against kvq_key_absmax; kvq_tk_score + kvq_tk_select (reduced query, critical
 *     channels, candidate scores, top-k in rank order; KVQ_TK_CHUNKS blocks per kv head, a block taking several
 *     strides at 9000 tokens) against kvq_reduce_q_group + kvq_critical_channels + kvq_critical_scores +
 *     kvq_topk; kvq_tk_dense against kvq_dense_preference_layer;
 *   - ZipCache: kvq_zip_stats + kvq_zip_saliency + kvq_zip_select against ref_saliency_prefill (classes) and
 *     softmax rows + kvq_saliency (saliency); kvq_zip_row + kvq_zip_rowsal + kvq_zip_select against the probe-row
 *     formula, kvq_saliency and ref_saliency_flush;
 *   - OTT: kvq_ott_compete, round after round on the same pools, against ref_outlier_step (pooled flags, rows,
 *     pool and spill state), the unmasking of evicted tokens (spill 0) and kvq_ott_undo.
 * One translation unit with every policy section, compiled for the emulator (with the sanitizers under make
 * test). Without the emulator: "skipped: <reason>", exit 0. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "cuda/cu_dev.h"
#include "emit_cuda.h"
#include "half.h"
#include "harness.h"
#include "kvq.h"
#include "kvq_params.cuh"
#include "layout.h"
#include "plan.h"
#include "policy.h"
#include "ref/ref.h"

#define NKV 2
#define NQ 4
#define GRP (NQ / NKV)
#define HD 128
#define NT 256 /* KVQ_PTHREADS */

static cu_dev *dev;
static cu_module *mod;

static uint64_t rng = 0x243f6a8885a308d3ull;
static double urand(void) /* [0, 1) */
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (double)(rng >> 11) * 0x1p-53;
}
static float srand1(void) { return (float)(2.0 * urand() - 1.0); } /* [-1, 1) */
static uint64_t A(const void *p) { return (uint64_t)(uintptr_t)p; }

static int launch3(const char *k, unsigned gx, unsigned gy, unsigned gz, unsigned bx, const void *p, size_t size)
{
    char msg[512];
    const unsigned g[3] = {gx, gy, gz}, b[3] = {bx, 1, 1};
    kvq_status st = cu_dev_launch(dev, mod, k, g, b, p, size, msg, sizeof msg);
    TH_CHECK(st == KVQ_OK, "%s: %s", k, msg);
    return st == KVQ_OK;
}

static int launch(const char *k, unsigned gx, unsigned gy, unsigned bx, const void *p, size_t size)
{
    return launch3(k, gx, gy, 1, bx, p, size);
}

/* ------------------------------------------------------------------------------------------- selection -- */

/* pattern 0 random, 1 few distinct values (ties), 2 special values */
static float sample(int pattern, int i)
{
    if (pattern == 1) return (float)(int)(urand() * 3) - 1.0f;
    if (pattern == 2) {
        static const float sp[] = {0.0f, -0.0f, 1.0f, -1.0f, 1e-40f, -1e-40f, 3.5f};
        switch ((int)(urand() * 10)) {
        case 0: return NAN;
        case 1: return INFINITY;
        case 2: return -INFINITY;
        default: return sp[i % 7];
        }
    }
    return srand1() * 100.0f;
}

static void test_select(void)
{
    th_begin("policy kernels: kvq_zip_select = kvq_select_salient (n 1..1000, k 0..n+3; ties, NaN, -0, inf)");
    static const int ns[] = {1, 2, 7, 256, 257, 1000};
    for (int a = 0; a < 6 && !th_failed(); a++)
        for (int pat = 0; pat < 3 && !th_failed(); pat++) {
            int n = ns[a];
            const int ks[] = {0, 1, n / 2, n - 1, n, n + 3};
            float *sal = kvq_malloc((size_t)NKV * n * sizeof *sal);
            unsigned char *hi = kvq_malloc((size_t)NKV * n), *want = kvq_malloc((size_t)NKV * n);
            unsigned *work = kvq_malloc(2 * (size_t)NKV * n * 4);
            for (int i = 0; i < NKV * n; i++) sal[i] = sample(pat, i);
            for (int b = 0; b < 6 && !th_failed(); b++) {
                kvq_zip_params p;
                memset(&p, 0, sizeof p);
                p.sal = A(sal), p.is_high = A(hi), p.work = A(work), p.n = n, p.n_high = ks[b];
                if (!launch("kvq_zip_select", NKV, 1, NT, &p, sizeof p)) break;
                for (int h = 0; h < NKV; h++) kvq_select_salient(sal + (size_t)h * n, n, ks[b], want + (size_t)h * n);
                TH_CHECK(!memcmp(hi, want, (size_t)NKV * n), "n %d k %d pattern %d: classes differ", n, ks[b], pat);
            }
            kvq_free(sal), kvq_free(hi), kvq_free(want), kvq_free(work);
        }
    th_end();
}

/* ---------------------------------------------------------------------------------------- TailorKV -- */

/* fp16 keys [NKV][T][HD]: pattern 0 random, 1 structured (outlier channels, duplicated rows: ties), 2 zero channels */
static void fill_keys(uint16_t *k16, int T, int pattern)
{
    for (int h = 0; h < NKV; h++)
        for (int t = 0; t < T; t++)
            for (int d = 0; d < HD; d++) {
                float v = srand1();
                if (pattern == 1) {
                    if (d % 19 == 4) v = 6.0f * v;
                    if (t % 7 == 3 && t >= 7) { /* a copy of the row 7 before: equal scores */
                        k16[((size_t)h * T + t) * HD + d] = k16[((size_t)h * T + t - 7) * HD + d];
                        continue;
                    }
                } else if (pattern == 2 && d % 3 == 0) {
                    v = 0.0f;
                }
                k16[((size_t)h * T + t) * HD + d] = kvq_f16_from_f32(v);
            }
}

static void test_tailorkv_select(void)
{
    th_begin("policy kernels: kvq_tk_absmax / kvq_tk_score / kvq_tk_select = kvq_key_absmax, critical channels, "
             "scores, kvq_topk");
    static const struct {
        int T, sinks, recent, topk, n_ch, pattern;
    } cs[] = {{300, 8, 24, 40, 8, 0}, {300, 8, 24, 40, 8, 1},     {300, 4, 4, 292, 128, 1}, {40, 2, 3, 1, 1, 2},
              {12, 2, 9, 5, 5, 0},    {1000, 8, 56, 128, 16, 1}, {50, 0, 0, 60, 3, 2},
              {9000, 8, 56, 128, 8, 0}};
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0] && !th_failed(); ci++) {
        int T = cs[ci].T, first = cs[ci].sinks, nc = T - cs[ci].sinks - cs[ci].recent;
        int nf = cs[ci].topk < nc ? cs[ci].topk : nc, n_ch = cs[ci].n_ch;
        uint16_t *k16 = kvq_malloc((size_t)NKV * T * HD * 2);
        float *kf = kvq_malloc((size_t)NKV * T * HD * 4), *q = kvq_malloc((size_t)NQ * HD * 4);
        float *am = kvq_malloc((size_t)NKV * HD * 4), *am_want = kvq_malloc((size_t)NKV * HD * 4);
        int *gidx = kvq_malloc((size_t)NKV * nf * 4), *want = kvq_malloc((size_t)nf * 4);
        unsigned *work = kvq_malloc(2 * (size_t)NKV * nc * 4);
        float *qm = kvq_malloc(HD * 4), *score = kvq_malloc((size_t)nc * 4);
        int *ch = kvq_malloc(HD * 4);
        fill_keys(k16, T, cs[ci].pattern);
        kvq_f32_from_f16_n(kf, k16, (size_t)NKV * T * HD);
        /* the kernels read the keys channel-major [h][d][t], as cu_slayer.c keeps them in host memory; the host
         * references below read the token-major k16/kf, so a kernel reading the wrong layout fails them */
        uint16_t *kc16 = kvq_malloc((size_t)NKV * T * HD * 2);
        for (int h = 0; h < NKV; h++)
            for (int t = 0; t < T; t++)
                for (int d = 0; d < HD; d++) kc16[((size_t)h * HD + d) * T + t] = k16[((size_t)h * T + t) * HD + d];
        for (int i = 0; i < NQ * HD; i++) q[i] = srand1() * (i % 5 == 0 ? 4.0f : 1.0f);
        if (cs[ci].pattern == 1) q[3] = -q[3 + HD]; /* reduced query 0 in a channel: ties among channel scores */
        kvq_tk_params p;
        memset(&p, 0, sizeof p);
        p.q = A(q), p.k = A(kc16), p.absmax = A(am), p.gather = A(gidx), p.work = A(work);
        p.T = T, p.first = first, p.nc = nc, p.nf = nf, p.n_ch = n_ch;
        memset(am, 0, (size_t)NKV * HD * 4); /* the kernel's contract: absmax zero before (cu_dev_alloc's fill) */
        if (launch("kvq_tk_absmax", NKV, KVQ_TK_CHUNKS, NT, &p, sizeof p) &&
            launch("kvq_tk_score", NKV, KVQ_TK_CHUNKS, NT, &p, sizeof p) && launch("kvq_tk_select", NKV, 1, NT, &p, sizeof p))
            for (int h = 0; h < NKV; h++) {
                kvq_key_absmax(kf + (size_t)h * T * HD, T, HD, am_want + (size_t)h * HD);
                TH_CHECK(!memcmp(am + (size_t)h * HD, am_want + (size_t)h * HD, HD * 4), "case %zu head %d: absmax", ci,
                         h);
                kvq_reduce_q_group(q, NQ, NKV, HD, h, qm);
                kvq_critical_channels(qm, am_want + (size_t)h * HD, HD, n_ch, ch);
                kvq_critical_scores(qm, kf + ((size_t)h * T + first) * HD, nc, HD, ch, n_ch, score);
                kvq_topk(score, nc, nf, want);
                int bad = -1;
                for (int i = 0; i < nf && bad < 0; i++)
                    if (gidx[h * nf + i] != first + want[i]) bad = i;
                TH_CHECK(bad < 0, "case %zu head %d: fetched row %d is %d, host %d", ci, h, bad,
                         bad >= 0 ? gidx[h * nf + bad] : 0, bad >= 0 ? first + want[bad] : 0);
            }
        kvq_free(k16), kvq_free(kf), kvq_free(q), kvq_free(am), kvq_free(am_want), kvq_free(gidx), kvq_free(want);
        kvq_free(kc16), kvq_free(work), kvq_free(qm), kvq_free(score), kvq_free(ch);
    }
    th_end();
}

static void test_tailorkv_dense(void)
{
    th_begin("policy kernels: kvq_tk_dense rows summed as the host = kvq_dense_preference_layer, bit for bit");
    static const struct {
        int n, n_q;
        double top;
        int dup;
    } cs[] = {{1, 1, 0.05, 0}, {7, 32, 0.05, 0}, {300, 32, 0.05, 0}, {300, 16, 0.0, 0},
              {60, 8, 1.0, 0}, {280, 20, 0.1, 1}, {257, 3, 0.02, 1}};
    const float scale = 1.0f / sqrtf((float)HD);
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0] && !th_failed(); ci++) {
        int n = cs[ci].n, n_q = cs[ci].n_q < n ? cs[ci].n_q : n, kk = kvq_frac_ceil(cs[ci].top, n);
        float *q = kvq_malloc((size_t)NQ * n * HD * 4), *k = kvq_malloc((size_t)NKV * n * HD * 4);
        float *logits = kvq_malloc((size_t)n_q * n * 4);
        unsigned *keys = kvq_malloc((size_t)n_q * n * 4);
        double *err = kvq_malloc((size_t)NQ * n_q * 8);
        for (size_t i = 0; i < (size_t)NQ * n * HD; i++) q[i] = srand1() * 3.0f;
        for (size_t i = 0; i < (size_t)NKV * n * HD; i++) k[i] = srand1() * 3.0f;
        if (cs[ci].dup) /* repeated keys: equal logits at the top-k threshold */
            for (int h = 0; h < NKV; h++)
                for (int t = 5; t < n; t += 3) memcpy(k + ((size_t)h * n + t) * HD, k + ((size_t)h * n + 2) * HD, HD * 4);
        int ok = 1;
        for (int h = 0; h < NQ && ok; h++) {
            kvq_dense_params p;
            memset(&p, 0, sizeof p);
            p.q = A(q + ((size_t)h * n + (n - n_q)) * HD), p.k = A(k + (size_t)(h / GRP) * n * HD);
            p.logits = A(logits), p.keys = A(keys), p.err = A(err + (size_t)h * n_q);
            p.scale = scale, p.n = n, p.n_q = n_q, p.kk = kk;
            ok = launch("kvq_tk_dense", (unsigned)n_q, 1, NT, &p, sizeof p);
        }
        double s = 0;
        for (int h = 0; h < NQ; h++) {
            double P = 0;
            for (int r = 0; r < n_q; r++) P += err[(size_t)h * n_q + r];
            s += P;
        }
        s /= (double)NQ * (double)n_q;
        double want = kvq_dense_preference_layer(q, k, NQ, NKV, n, HD, cs[ci].n_q, cs[ci].top, scale, NULL);
        TH_CHECK(!ok || memcmp(&s, &want, sizeof s) == 0, "case %zu: %.17g, host %.17g", ci, s, want);
        kvq_free(q), kvq_free(k), kvq_free(logits), kvq_free(keys), kvq_free(err);
    }
    th_end();
}

/* ---------------------------------------------------------------------------------------- ZipCache -- */

/* ref_saliency.c's softmax_add (ZipCache Eq. 9; the denominator a fixed-point integer sum) */
static void softmax_add(const float *q, const float *K, int n, float scale, double *logit, float *acc)
{
    double mx = -INFINITY;
    uint64_t z = 0;
    for (int t = 0; t < n; t++) {
        double s = 0;
        for (int c = 0; c < HD; c++) s += (double)q[c] * (double)K[(size_t)t * HD + c];
        logit[t] = s * (double)scale;
        if (logit[t] > mx) mx = logit[t];
    }
    if (mx == 0) mx = 0.0;
    for (int t = 0; t < n; t++) {
        logit[t] = kvq_exp_det(logit[t] - mx);
        z += kvq_prob_fixed(logit[t]);
    }
    double den = (double)z * KVQ_PROB_FIXED_UNIT;
    for (int t = 0; t < n; t++) acc[t] = (float)((double)acc[t] + logit[t] / den);
}

static void zip_cfg(kvq_quant_cfg *cfg, kvq_saliency_metric metric)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->saliency.metric = metric;
    cfg->saliency.probe_recent = 0.1, cfg->saliency.probe_random = 0.1;
    cfg->saliency.salient = 0.6, cfg->saliency.high_bits = 4, cfg->saliency.low_bits = 2;
}

static void test_zip_prefill(void)
{
    th_begin("policy kernels: kvq_zip_stats_max/stats/saliency/select over key chunks = ref_saliency_prefill's classes, "
             "saliency bit for bit");
    static const struct {
        int T, first, n, metric, structured;
    } cs[] = {{1, 0, 1, KVQ_SAL_NORMALIZED, 0},     {5, 1, 3, KVQ_SAL_NORMALIZED, 0},
              {300, 4, 260, KVQ_SAL_NORMALIZED, 1}, {300, 0, 300, KVQ_SAL_ACCUMULATED, 1},
              {90, 2, 80, KVQ_SAL_ACCUMULATED, 0},  {270, 0, 258, KVQ_SAL_NORMALIZED, 2}};
    const float scale = 1.0f / sqrtf((float)HD);
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0] && !th_failed(); ci++) {
        int T = cs[ci].T, first = cs[ci].first, n = cs[ci].n;
        kvq_quant_cfg cfg;
        zip_cfg(&cfg, (kvq_saliency_metric)cs[ci].metric);
        ref_qlayer L;
        memset(&L, 0, sizeof L);
        L.cfg = &cfg, L.H = NKV, L.Hq = NQ, L.D = HD, L.scale = scale, L.seed = 0x5eed0000ull + ci;
        uint16_t *k16 = kvq_malloc((size_t)NKV * T * HD * 2);
        float *kf = kvq_malloc((size_t)NKV * T * HD * 4), *q = kvq_malloc((size_t)NQ * T * HD * 4);
        fill_keys(k16, T, cs[ci].structured == 1 ? 1 : 0);
        if (cs[ci].structured == 2) /* every token the same key: saliency ties everywhere */
            for (int h = 0; h < NKV; h++)
                for (int t = 1; t < T; t++) memcpy(k16 + ((size_t)h * T + t) * HD, k16 + (size_t)h * T * HD, HD * 2);
        kvq_f32_from_f16_n(kf, k16, (size_t)NKV * T * HD);
        for (size_t i = 0; i < (size_t)NQ * T * HD; i++) q[i] = srand1() * 2.0f;
        int *pos = kvq_malloc((size_t)T * 4);
        int np = kvq_select_probes(&cfg.saliency, 0, T, L.seed, pos);
        float *qp = kvq_malloc((size_t)NQ * np * HD * 4);
        for (int hq = 0; hq < NQ; hq++)
            for (int r = 0; r < np; r++)
                memcpy(qp + ((size_t)hq * np + r) * HD, q + ((size_t)hq * T + pos[r]) * HD, HD * 4);
        double *stats = kvq_malloc((size_t)NQ * np * 16);
        float *sal = kvq_malloc((size_t)NKV * n * 4), *want_sal = kvq_malloc((size_t)T * 4);
        unsigned char *hi = kvq_malloc((size_t)NKV * n), *want = kvq_malloc((size_t)NKV * n);
        unsigned *work = kvq_malloc(2 * (size_t)NKV * n * 4);
        kvq_zip_params p;
        memset(&p, 0, sizeof p);
        p.q = A(qp), p.pos = A(pos), p.stats = A(stats), p.sal = A(sal), p.is_high = A(hi), p.work = A(work);
        p.k.base = A(k16), p.k.f16 = 1, p.k.head_stride = T;
        p.scale = (double)scale, p.np = np, p.first = first, p.n = n;
        p.accumulated = cs[ci].metric == KVQ_SAL_ACCUMULATED, p.n_high = kvq_saliency_high_count(&cfg.saliency, n);
        /* key chunks of 64 (the runtime's are KVQ_ZS_CHUNK = 2048): rows of up to 5 chunks, summed by atomics in
         * whatever order the blocks run (KVQ_EMU_SHUFFLE) */
        p.chunk = 64;
        unsigned nch = (unsigned)((T + 63) / 64);
        memset(stats, 0, (size_t)NQ * np * 16);
        int ok = launch3("kvq_zip_stats_max", (unsigned)np, NQ, nch, NT, &p, sizeof p) &&
                 launch3("kvq_zip_stats", (unsigned)np, NQ, nch, NT, &p, sizeof p) &&
                 launch("kvq_zip_saliency", (unsigned)((n + NT - 1) / NT), NKV, NT, &p, sizeof p) &&
                 launch("kvq_zip_select", NKV, 1, NT, &p, sizeof p);
        ref_arena ar;
        ref_arena_init(&ar, ref_saliency_prefill_scratch_bytes(&L, T, n));
        ref_saliency_prefill(&L, kf, q, T, first, n, want, &ar);
        ref_arena_free(&ar);
        TH_CHECK(!ok || !memcmp(hi, want, (size_t)NKV * n), "case %zu: classes differ from ref_saliency_prefill", ci);
        /* the saliency itself, from the host's rows */
        float *Ar = kvq_calloc((size_t)np * T, 4);
        double *logit = kvq_malloc((size_t)T * 8);
        for (int h = 0; h < NKV && ok; h++) {
            memset(Ar, 0, (size_t)np * T * 4);
            for (int j = 0; j < GRP; j++)
                for (int r = 0; r < np; r++)
                    softmax_add(q + ((size_t)(h * GRP + j) * T + pos[r]) * HD, kf + (size_t)h * T * HD, pos[r] + 1, scale,
                                logit, Ar + (size_t)r * T);
            kvq_saliency((kvq_saliency_metric)cs[ci].metric, Ar, pos, np, T, want_sal);
            TH_CHECK(!memcmp(sal + (size_t)h * n, want_sal + first, (size_t)n * 4), "case %zu head %d: saliency", ci,
                     h);
        }
        kvq_free(Ar), kvq_free(logit), kvq_free(k16), kvq_free(kf), kvq_free(q), kvq_free(pos), kvq_free(qp);
        kvq_free(stats), kvq_free(sal), kvq_free(want_sal), kvq_free(hi), kvq_free(want), kvq_free(work);
    }
    th_end();
}

static void test_zip_decode(void)
{
    th_begin("policy kernels: kvq_zip_row/rowsal/select = the probe-row formula, kvq_saliency, ref_saliency_flush");
    const int wcap = 40, cap = 41; /* the key window: a ring of 41 slots holding wcap tokens at most */
    const double sc = 1.0 / sqrt((double)HD);
    for (int metric = KVQ_SAL_NORMALIZED; metric <= KVQ_SAL_ACCUMULATED && !th_failed(); metric++)
        for (int head0 = 0; head0 < cap; head0 += 17) {
            kvq_quant_cfg cfg;
            zip_cfg(&cfg, (kvq_saliency_metric)metric);
            uint16_t *win = kvq_malloc((size_t)NKV * cap * HD * 2);
            float *q = kvq_malloc((size_t)NQ * HD * 4);
            double norm[NQ][2]; /* kvq_zip_norm's max logit and normaliser */
            int nr = 6, ppos[6] = {0, 9, 9, 20, 33, 39}; /* relative positions; 9 twice: equal rows */
            float *rows = kvq_calloc((size_t)nr * NKV * wcap, 4), *want = kvq_calloc((size_t)nr * NKV * wcap, 4);
            fill_keys(win, cap, 0);
            for (int r = 0; r < nr && !th_failed(); r++) {
                int count = ppos[r] + 1; /* the probe sees the window up to itself */
                for (int i = 0; i < NQ * HD; i++) q[i] = srand1() * (r == 2 ? 0.0f : 2.0f); /* row 2: uniform */
                for (int i = 0; i < NQ; i++) norm[i][0] = 2.0 + urand() * 4.0, norm[i][1] = 1.0 + urand() * 40.0;
                kvq_zip_params p;
                memset(&p, 0, sizeof p);
                p.q = A(q), p.norm = A(norm), p.rows = A(rows), p.scale = sc, p.row = r, p.wcap = wcap, p.count = count;
                p.k.base = A(win), p.k.f16 = 1, p.k.head_stride = cap, p.k.first = head0, p.k.ring = cap;
                if (!launch("kvq_zip_row", NKV, 1, NT, &p, sizeof p)) break;
                for (int h = 0; h < NKV; h++)
                    for (int sl = 0; sl < count; sl++) {
                        const uint16_t *kk = win + ((size_t)h * cap + (head0 + sl) % cap) * HD;
                        double acc = 0;
                        for (int j = 0; j < GRP; j++) {
                            double s = 0;
                            for (int x = 0; x < HD; x++)
                                s += (double)q[(h * GRP + j) * HD + x] * (double)kvq_f32_from_f16(kk[x]);
                            /* ref_attend's probe probabilities (kvq_exp_det, then / Z, rounded to fp32 twice) */
                            float e = (float)kvq_exp_det(s * sc - norm[h * GRP + j][0]);
                            acc += (double)(float)((double)e / norm[h * GRP + j][1]);
                        }
                        want[((size_t)r * NKV + h) * wcap + sl] = (float)acc;
                    }
            }
            TH_CHECK(!memcmp(rows, want, (size_t)nr * NKV * wcap * 4), "rows differ (window head %d)", head0);
            for (int B = 1; B <= wcap && !th_failed(); B += 13) {
                float *sal = kvq_malloc((size_t)NKV * B * 4), *ws = kvq_malloc((size_t)B * 4);
                unsigned char *hi = kvq_malloc((size_t)NKV * B), *wh = kvq_malloc((size_t)NKV * B);
                unsigned *work = kvq_malloc(2 * (size_t)NKV * B * 4);
                kvq_zip_params p;
                memset(&p, 0, sizeof p);
                p.pos = A(ppos), p.rows = A(rows), p.sal = A(sal), p.is_high = A(hi), p.work = A(work);
                p.np = nr, p.n = B, p.wcap = wcap, p.accumulated = metric == KVQ_SAL_ACCUMULATED;
                p.n_high = kvq_saliency_high_count(&cfg.saliency, B);
                int ok = launch("kvq_zip_rowsal", (unsigned)((B + NT - 1) / NT), NKV, NT, &p, sizeof p) &&
                         launch("kvq_zip_select", NKV, 1, NT, &p, sizeof p);
                float *Ar = kvq_malloc((size_t)nr * B * 4);
                for (int h = 0; h < NKV && ok; h++) {
                    for (int r = 0; r < nr; r++) memcpy(Ar + (size_t)r * B, rows + ((size_t)r * NKV + h) * wcap, B * 4);
                    kvq_saliency((kvq_saliency_metric)metric, Ar, ppos, nr, B, ws);
                    TH_CHECK(!memcmp(sal + (size_t)h * B, ws, (size_t)B * 4), "B %d head %d: saliency", B, h);
                }
                /* the decisions against the reference's own flush over the same rows */
                ref_qlayer L;
                memset(&L, 0, sizeof L);
                int abs_pos[6];
                for (int r = 0; r < nr; r++) abs_pos[r] = 1000 + ppos[r];
                L.cfg = &cfg, L.H = NKV, L.Hq = NQ, L.D = HD, L.probe_cap = nr, L.probe_pos = abs_pos, L.n_rows = nr;
                L.n_probes = nr, L.cycle_first = 1000, L.rows = rows, L.rule[0].capacity = wcap;
                ref_arena ar;
                ref_arena_init(&ar, ref_saliency_flush_scratch_bytes(&L, B));
                ref_saliency_flush(&L, B, wh, &ar);
                ref_arena_free(&ar);
                TH_CHECK(!ok || !memcmp(hi, wh, (size_t)NKV * B), "B %d: classes differ from ref_saliency_flush", B);
                kvq_free(sal), kvq_free(ws), kvq_free(hi), kvq_free(wh), kvq_free(work), kvq_free(Ar);
            }
            kvq_free(win), kvq_free(q), kvq_free(rows), kvq_free(want);
        }
    th_end();
}

/* --------------------------------------------------------------------------------------------- OTT -- */

typedef struct {
    int N, S, Gk, largest;
} ott_case;

/* fp16 rows equal bit for bit, except that any two NaNs match: the device moves a NaN's bits, the host widens
 * and narrows it (its payload may change) */
static int f16_same(const uint16_t *a, const uint16_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        int na = (a[i] & 0x7fff) > 0x7c00, nb = (b[i] & 0x7fff) > 0x7c00;
        if (na != nb || (!na && a[i] != b[i])) return 0;
    }
    return 1;
}

/* A flush's fp16 rows [NKV][B][HD]: random norms, some duplicated rows (equal L1: ties go to the earlier token),
 * a NaN row (ranks last), rows copying a pooled token (ties with a pool member). */
static void ott_rows(uint16_t *k, uint16_t *v, int B, int round, int largest)
{
    /* norms drift toward the outlier end round after round, so that members keep being evicted */
    double drift = largest ? 1.0 + 0.5 * round : 1.0 / (1.0 + 0.5 * round);
    for (int h = 0; h < NKV; h++)
        for (int i = 0; i < B; i++) {
            float amp = (float)((0.05 + urand() * 2.0) * drift);
            for (int d = 0; d < HD; d++) {
                k[((size_t)h * B + i) * HD + d] = kvq_f16_from_f32(srand1() * amp);
                v[((size_t)h * B + i) * HD + d] = kvq_f16_from_f32(srand1());
            }
            if (i >= 2 && i % 5 == 2) memcpy(k + ((size_t)h * B + i) * HD, k + ((size_t)h * B + i - 2) * HD, HD * 2);
            if (round == 3 && i == 1) k[((size_t)h * B + i) * HD + 7] = 0x7e00; /* NaN */
        }
}

static void test_ott(const ott_case *oc)
{
    th_begin("policy kernels: kvq_ott_compete = ref_outlier_step over 7 rounds (keep %d, spill %d, group %d, %s)",
             oc->N, oc->S, oc->Gk, oc->largest ? "largest" : "smallest");
    const int N = oc->N, S = oc->S, rounds = 7;
    static const int Bs[7] = {6, 1, 12, 9, 2, 24, 5};
    kvq_quant_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.key.group = oc->Gk, cfg.outliers.keep = N, cfg.outliers.spill = S;
    cfg.outliers.metric = oc->largest ? KVQ_OUTLIER_KEY_L1_LARGEST : KVQ_OUTLIER_KEY_L1_SMALLEST;
    ref_qlayer L;
    memset(&L, 0, sizeof L);
    L.cfg = &cfg, L.H = NKV, L.Hq = NQ, L.D = HD;
    ref_pool_init(&L.pool, NKV, HD, N);
    ref_pool_init(&L.spill, NKV, HD, S);
    size_t mb = (size_t)kvq_ott_meta_off(NKV, N, S, KVQ_OM_END);
    unsigned char *meta[2] = {kvq_calloc(1, mb), kvq_calloc(1, mb)};
    uint16_t *prow[2] = {kvq_calloc((size_t)2 * NKV * N * HD, 2), kvq_calloc((size_t)2 * NKV * N * HD, 2)};
    uint16_t *srow = kvq_calloc((size_t)2 * NKV * (S > 0 ? S : 1) * HD, 2);
    /* each round's key pages' mask sections: [round][page][NKV][ceil(n_c / 8)], aligned as a page's */
    const size_t mtotal = (size_t)rounds * 8 * NKV * 16;
    unsigned char *masks = kvq_calloc(mtotal, 1), *pre = kvq_malloc(mtotal);
    static unsigned char *loc_byte[NKV][256]; /* where each pooled token's key mask bit is */
    static int loc_bit[NKV][256];
    memset(loc_byte, 0, sizeof loc_byte);
    int cur = 0, pos0 = 100, total_evicted = 0;
    for (int r = 0; r < rounds && !th_failed(); r++) {
        int B = Bs[r], Gp = oc->Gk > 0 ? oc->Gk : B, npg = (B + Gp - 1) / Gp;
        uint16_t *k = kvq_malloc((size_t)NKV * B * HD * 2), *v = kvq_malloc((size_t)NKV * B * HD * 2);
        uint16_t *out = kvq_malloc((size_t)2 * NKV * B * HD * 2);
        float *xk = kvq_malloc((size_t)NKV * B * HD * 4), *xv = kvq_malloc((size_t)NKV * B * HD * 4);
        unsigned char *flags = kvq_malloc((size_t)NKV * B + 16), *pooled = kvq_malloc((size_t)NKV * B);
        int *work = kvq_malloc((size_t)NKV * (2 * B + 4 * N + 8) * 4);
        uint64_t mbase[8];
        for (int j = 0; j < npg; j++) mbase[j] = A(masks + ((size_t)r * 8 + j) * NKV * 16);
        ott_rows(k, v, B, r, oc->largest);
        kvq_f32_from_f16_n(xk, k, (size_t)NKV * B * HD);
        kvq_f32_from_f16_n(xv, v, (size_t)NKV * B * HD);
        /* the pool before the round (positions), to know who is evicted */
        int before[NKV][8], nb[NKV];
        for (int h = 0; h < NKV; h++) {
            nb[h] = L.pool.count[h];
            for (int s = 0; s < nb[h]; s++) before[h][s] = L.pool.pos[h * N + s];
        }
        kvq_ott_params p;
        memset(&p, 0, sizeof p);
        p.k.base = A(k), p.k.f16 = 1, p.k.head_stride = B, p.v = p.k, p.v.base = A(v);
        p.meta_in = A(meta[cur]), p.meta_out = A(meta[cur ^ 1]), p.pool_in = A(prow[cur]), p.pool_out = A(prow[cur ^ 1]);
        p.spill = A(srow), p.out_k = A(out), p.out_v = A(out + (size_t)NKV * B * HD), p.flags = A(flags);
        p.mask = S == 0 ? A(mbase) : 0, p.work = A(work);
        p.B = B, p.first_pos = pos0, p.keep = N, p.spill_cap = S, p.largest = oc->largest, p.group = oc->Gk;
        memcpy(pre, masks, mtotal);
        if (!launch("kvq_ott_compete", NKV, 1, NT, &p, sizeof p)) break;
        ref_arena ar;
        ref_arena_init(&ar, ref_outlier_scratch_bytes(B));
        ref_outlier_step(&L, xk, xv, B, pos0, pooled, &ar);
        ref_arena_free(&ar);
        /* pooled flags (by key page), the rows to quantize */
        for (int h = 0; h < NKV; h++)
            for (int i = 0; i < B; i++) {
                int c0 = i / Gp * Gp, nc = B - c0 < Gp ? B - c0 : Gp;
                TH_CHECK(flags[(size_t)c0 * NKV + (size_t)h * nc + (i - c0)] == pooled[h * B + i],
                         "round %d head %d token %d: pooled %d, host %d", r, h, i,
                         flags[(size_t)c0 * NKV + (size_t)h * nc + (i - c0)], pooled[h * B + i]);
            }
        int bad = -1;
        for (size_t i = 0; i < (size_t)NKV * B * HD && bad < 0; i++) {
            uint16_t hk = kvq_f16_from_f32(xk[i]), hv = kvq_f16_from_f32(xv[i]);
            if (!f16_same(&out[i], &hk, 1) || !f16_same(&out[(size_t)NKV * B * HD + i], &hv, 1)) bad = (int)i;
        }
        TH_CHECK(bad < 0, "round %d: row %d channel %d differs from the host's mean replacement", r, bad / HD, bad % HD);
        /* the pool and spill state, slot by slot */
        const unsigned char *mo = meta[cur ^ 1];
        const int *cnt = (const int *)(mo + kvq_ott_meta_off(NKV, N, S, KVQ_OM_COUNT));
        const int *scnt = (const int *)(mo + kvq_ott_meta_off(NKV, N, S, KVQ_OM_SCOUNT));
        const int *pp = (const int *)(mo + kvq_ott_meta_off(NKV, N, S, KVQ_OM_POS));
        const float *psc = (const float *)(mo + kvq_ott_meta_off(NKV, N, S, KVQ_OM_SCORE));
        const int *spp = (const int *)(mo + kvq_ott_meta_off(NKV, N, S, KVQ_OM_SPOS));
        for (int h = 0; h < NKV; h++) {
            TH_CHECK(cnt[h] == L.pool.count[h] && scnt[h] == (S ? L.spill.count[h] : 0),
                     "round %d head %d: counts %d/%d, host %d/%d", r, h, cnt[h], scnt[h], L.pool.count[h],
                     S ? L.spill.count[h] : 0);
            for (int s = 0; s < L.pool.count[h] && s < N; s++) {
                TH_CHECK(pp[h * N + s] == L.pool.pos[h * N + s] &&
                             !memcmp(&psc[h * N + s], &L.pool.score[h * N + s], 4),
                         "round %d head %d pool slot %d: position %d, host %d", r, h, s, pp[h * N + s],
                         L.pool.pos[h * N + s]);
                size_t o = ((size_t)h * N + s) * HD;
                TH_CHECK(f16_same(prow[cur ^ 1] + o, L.pool.k + o, HD) &&
                             f16_same(prow[cur ^ 1] + (size_t)NKV * N * HD + o, L.pool.v + o, HD),
                         "round %d head %d pool slot %d: rows", r, h, s);
            }
            for (int s = 0; S && s < L.spill.count[h]; s++) {
                size_t o = ((size_t)h * S + s) * HD;
                TH_CHECK(spp[h * S + s] == L.spill.pos[h * S + s] && f16_same(srow + o, L.spill.k + o, HD) &&
                             f16_same(srow + (size_t)NKV * S * HD + o, L.spill.v + o, HD),
                         "round %d head %d spill slot %d", r, h, s);
            }
        }
        /* spill 0: exactly the evicted members' key slots were unmasked; kvq_ott_undo masks them back */
        if (S == 0 && !th_failed()) {
            int evicted = 0, wrong = 0, cleared = 0;
            for (size_t i = 0; i < mtotal; i++) cleared += __builtin_popcount((unsigned)(pre[i] & ~masks[i]));
            for (int h = 0; h < NKV; h++)
                for (int s = 0; s < nb[h]; s++) {
                    int gone = 1, at = before[h][s];
                    for (int u = 0; u < L.pool.count[h]; u++) gone &= L.pool.pos[h * N + u] != at;
                    if (!gone) continue;
                    evicted++;
                    wrong += !loc_byte[h][at] || (*loc_byte[h][at] >> loc_bit[h][at] & 1);
                }
            total_evicted += evicted;
            TH_CHECK(cleared == evicted && !wrong, "round %d: %d bits cleared, host evicted %d (%d not cleared)", r,
                     cleared, evicted, wrong);
            if (launch("kvq_ott_undo", NKV, 1, 32, &p, sizeof p))
                TH_CHECK(!memcmp(pre, masks, mtotal), "round %d: kvq_ott_undo did not restore the mask bits", r);
            memcpy(masks, pre, mtotal); /* the step that follows starts from the committed state */
            if (evicted) /* redo it: the state the next round starts from */
                launch("kvq_ott_compete", NKV, 1, NT, &p, sizeof p);
        }
        /* the pages' writers set the mask bits of the round's pooled tokens (kvq_set_mask_bits) */
        for (int h = 0; h < NKV && S == 0; h++)
            for (int i = 0; i < B; i++)
                if (pooled[h * B + i]) {
                    int c0 = i / Gp * Gp, nc = B - c0 < Gp ? B - c0 : Gp, sl = i - c0;
                    unsigned char *byte = (unsigned char *)(uintptr_t)mbase[i / Gp] + h * ((nc + 7) / 8) + sl / 8;
                    *byte |= (unsigned char)(1u << (sl & 7));
                    loc_byte[h][pos0 + i] = byte, loc_bit[h][pos0 + i] = sl & 7;
                }
        cur ^= 1;
        pos0 += B;
        kvq_free(k), kvq_free(v), kvq_free(out), kvq_free(xk), kvq_free(xv), kvq_free(flags), kvq_free(pooled);
        kvq_free(work);
    }
    /* the rounds exercised what they are for: evictions to the body, to the spill pool, a full spill pool */
    if (S == 0) TH_CHECK(total_evicted > 0, "no token was ever evicted back to the body");
    for (int h = 0; h < NKV && S > 0; h++)
        TH_CHECK(L.spill.count[h] > 0 && (S > 2 || L.spill.count[h] == S), "head %d: spill pool holds %d", h,
                 L.spill.count[h]);
    ref_pool_free(&L.pool);
    ref_pool_free(&L.spill);
    kvq_free(meta[0]), kvq_free(meta[1]), kvq_free(prow[0]), kvq_free(prow[1]), kvq_free(srow), kvq_free(masks), kvq_free(pre);
    th_end();
}

int main(void)
{
    char msg[2048];
    kvq_status st = cu_dev_open(CU_DEV_EMU, &dev, msg, sizeof msg);
    if (st != KVQ_OK) {
        printf("skipped: %s\n", msg);
        return 0;
    }
    /* one unit with every policy section: a plan of any scheme with every policy flag set */
    kvq_spec *spec = NULL;
    kvq_plan *plan = kvq_malloc(sizeof *plan);
    char *src = NULL;
    kvq_dims dims = {1, NQ, NKV, HD};
    th_begin("policy kernels: the unit compiles for the emulator");
    TH_CHECK(kvq_spec_parse_file(th_path("specs/fp16.kvq"), &spec) == KVQ_OK, "specs/fp16.kvq");
    TH_CHECK(plan && plan_build(kvq_spec_scheme(spec, NULL), &dims, KVQ_F32, plan, msg, sizeof msg) == KVQ_OK,
             "plan: %s", msg);
    if (!th_failed()) {
        plan->any_pool = plan->any_saliency = plan->any_sparse = plan->any_auto = 1;
        TH_CHECK(emit_cuda_source(plan, &src, NULL) == KVQ_OK, "emit");
        st = src ? cu_dev_load(dev, src, NULL, &mod, msg, sizeof msg) : KVQ_ERR_NOMEM;
        TH_CHECK(st == KVQ_OK, "load: %s", msg);
    }
    th_end();
    if (mod) {
        test_select();
        test_tailorkv_select();
        test_tailorkv_dense();
        test_zip_prefill();
        test_zip_decode();
        static const ott_case oc[] = {{3, 32, 4, 0}, {3, 2, 4, 1}, {3, 0, 4, 0}, {4, 0, 0, 1}, {1, 0, 8, 0}};
        for (size_t i = 0; i < sizeof oc / sizeof oc[0]; i++) test_ott(&oc[i]);
    }
    cu_module_free(mod);
    kvq_free(src);
    kvq_free(plan);
    kvq_spec_free(spec);
    cu_dev_close(dev);
    return th_summary();
}
