/* TurboQuant's outlier channel split (arXiv 2504.19874 Sec. 4.3; `outlier_channels N bits B`, docs/language.md
 * "TurboQuant's channel split") on the specs named for the paper's settings, specs/rotate/turboquant-2.5bit.kvq
 * and turboquant-3.5bit.kvq:
 * - the bits: `kvqc report`'s accounting gives exactly 2.5 and 3.5 bits of codes per channel (2.25 for the paper's
 *   example as printed), and its parameters are exactly the norms and the prompt's channel masks;
 * - through the engine on the reference backend: the decode output is attention over what the cache holds, the
 *   engine's memory equals the accounting, the chosen outlier channels are the prompt's largest, and the
 *   distortion is that of the two instances: sum over tokens of |x_out|^2 D(B) + |x_rest|^2 D(b) for mse values
 *   (Theorem 1 per instance), and with the QJL term's variance for prod keys;
 * - the split prod estimator (the two instances' estimates added) is unbiased (Theorem 2) over many pairs. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "harness.h"
#include "rotation.h"
#include "test_engine_util.h"
#include "turboquant.h"

#define D 128

/* Theorem 1's distortion of unit vectors (the Lloyd-Max errors of N(0, 1)) at b = 1..4. */
static const double dmse[5] = {0, 0.3634, 0.1175, 0.03455, 0.0095};

typedef struct {
    const char *file, *name;
    double code_bits; /* bits of codes (QJL signs included) per channel the spec states */
} split_spec;

static const split_spec specs[] = {
    {"specs/rotate/turboquant-2.5bit.kvq", "turboquant-2p5", 2.5},
    {"specs/rotate/turboquant-2.5bit.kvq", "turboquant-32x3-96x2", 2.25},
    {"specs/rotate/turboquant-3.5bit.kvq", "turboquant-3p5", 3.5},
    {"specs/rotate/turboquant-2.5bit.kvq", "turboquant-2p5-mse", 2.5},
    {"specs/rotate/turboquant-3.5bit.kvq", "turboquant-3p5-mse", 3.5},
};

/* Bits of one token's codes (QJL included) of tensor t at head_dim D, from the spec alone. */
static double tensor_code_bits(const kvq_tensor_cfg *t)
{
    return (double)t->tq_outliers * t->tq_outlier_bits + (double)(D - t->tq_outliers) * t->bits;
}

static void test_accounting(const split_spec *sp)
{
    th_begin("%s (%s): kvqc report's accounting: %.2f bits of codes per channel, norms and channel masks exact",
             sp->name, sp->file, sp->code_bits);
    enum { L = 2, Hq = 8, H = 2, B = 3, T = 1000 };
    kvq_spec *f = tu_spec_file(sp->file);
    const kvq_scheme *s = f ? kvq_spec_scheme(f, sp->name) : NULL;
    TH_CHECK(s, "scheme %s", sp->name);
    kvq_dims dims = {L, Hq, H, D};
    kvq_mem_stats m;
    TH_CHECK(!th_failed() && kvq_scheme_account(s, &dims, B, T, NULL, &m) == KVQ_OK, "account");
    if (!th_failed()) {
        const kvq_tensor_cfg *k = &s->base.quant.key, *v = &s->base.quant.value;
        double elems = (double)L * B * H * T * D * 2;
        double bits = m.bytes[KVQ_SEG_BODY_HIGH] * 8.0 / elems;
        /* the spec's own arithmetic: (N x B + (D - N) x b) / D per tensor */
        double stated = (tensor_code_bits(k) + tensor_code_bits(v)) / (2.0 * D);
        printf("  %s: body %llu bytes = %.4f bits per element (stated %.4f); params %llu bytes; effective %.4f\n",
               sp->name, (unsigned long long)m.bytes[KVQ_SEG_BODY_HIGH], bits, sp->code_bits,
               (unsigned long long)m.bytes[KVQ_SEG_PARAMS], m.effective_bits);
        TH_CHECK(bits == sp->code_bits && stated == sp->code_bits, "body %.6f bits, spec arithmetic %.6f, stated %.2f",
                 bits, stated, sp->code_bits);
        /* params per (layer, sequence): an fp32 norm per part and token (prod: and the residual's), and a
         * head_dim-bit mask per kv head and tensor; T x H x 2 x 4 bytes is a multiple of 16 (no padding) */
        uint64_t per = (uint64_t)T * H * 2 * 4 * (k->turboquant == KVQ_TQ_PROD ? 2 : 1) +
                       (uint64_t)T * H * 2 * 4 * (v->turboquant == KVQ_TQ_PROD ? 2 : 1) + 2 * H * (D / 8);
        TH_CHECK(m.bytes[KVQ_SEG_PARAMS] == per * L * B, "params %llu bytes, expected %llu",
                 (unsigned long long)m.bytes[KVQ_SEG_PARAMS], (unsigned long long)(per * L * B));
        TH_CHECK(m.device_bytes == m.bytes[KVQ_SEG_BODY_HIGH] + m.bytes[KVQ_SEG_PARAMS], "nothing else is stored");
        double eff = (sp->code_bits * elems + (double)per * L * B * 8) / elems;
        TH_CHECK(fabs(m.effective_bits - eff) < 1e-12, "effective bits %.6f, expected %.6f", m.effective_bits, eff);
    }
    kvq_spec_free(f);
    th_end();
}

/* The n largest of ss[D] (ties to the lower channel), as rt_rotate.c chooses them. */
static void top_channels(const double *ss, int n, unsigned char *is_out)
{
    memset(is_out, 0, D);
    for (int k = 0; k < n; k++) {
        int best = -1;
        for (int c = 0; c < D; c++)
            if (!is_out[c] && (best < 0 || ss[c] > ss[best])) best = c;
        is_out[best] = 1;
    }
}

/* Expected squared error of one part of norm^2 n2 at `bits` and dimension m: Theorem 1's for mse. For prod the
 * stored key is y_mse + est(r), so its error is the QJL reconstruction's, E|est - r|^2 = |r|^2 (pi/2 - 1/m) for
 * m = D rows (E[s sign(s.u)] = sqrt(2/pi) u for s ~ N(0, I), |u| = 1), with E|r|^2 = n2 D(bits - 1). */
static double part_error(double n2, int bits, int prod, int m)
{
    if (!prod) return n2 * dmse[bits];
    return n2 * dmse[bits - 1] * (M_PI / 2 - 1.0 / m);
}

static void test_engine(const split_spec *sp)
{
    th_begin("%s on the reference: decode = attention over read_cache, stats = account, prompt's outlier channels, "
             "distortion of the two instances",
             sp->name);
    enum { H = 2, Hq = 4, T = 400, L = 1 };
    kvq_spec *f = tu_spec_file(sp->file);
    const kvq_scheme *s = f ? kvq_spec_scheme(f, sp->name) : NULL;
    TH_CHECK(s, "scheme %s", sp->name);
    kvq_engine *e = s ? tu_engine(s, L, Hq, H, D, KVQ_F32) : NULL;
    kvq_synth_params p = kvq_synth_params_default();
    p.layers = 4, p.kv_heads = H, p.heads = Hq, p.head_dim = D, p.tokens = T + 1, p.seed = 5;
    kvq_synth syn = {0};
    char err[256];
    TH_CHECK(kvq_synth_generate(&p, &syn, err, sizeof err) == KVQ_OK, "synth: %s", err);
    tu_prompt_step r = {.kv_heads = H, .heads = Hq, .tokens = T, .dim = D};
    if (!th_failed()) tu_prompt_step_run(e, s, &syn, 3, &r); /* layer 3: outlier key channels (and value channels) */
    double worst_self = r.worst_self, worst_exact = r.worst_exact;
    const float *k = r.k, *v = r.v, *rk = r.rk, *rv = r.rv;
    TH_CHECK(worst_self < 1e-4, "decode differs from attention over what the cache holds by %.3g", worst_self);
    /* Distortion per tensor: measured sum of |x - x^|^2 over every token (the decoded one with the prompt's
     * channels) against the two instances' expected errors on the prompt-chosen channel sets. */
    for (int w = 0; w < 2 && !th_failed(); w++) {
        const kvq_tensor_cfg *t = w ? &s->base.quant.value : &s->base.quant.key;
        const float *x = w ? v : k, *y = w ? rv : rk;
        int prod = t->turboquant == KVQ_TQ_PROD, No = t->tq_outliers;
        double meas = 0, pred = 0, pred_single = 0;
        for (int h = 0; h < H; h++) {
            const float *xh = x + (size_t)h * (T + 1) * D, *yh = y + (size_t)h * (T + 1) * D;
            double ss[D] = {0};
            unsigned char is_out[D];
            for (int i = 0; i < T; i++)
                for (int c = 0; c < D; c++) ss[c] += (double)xh[(size_t)i * D + c] * xh[(size_t)i * D + c];
            top_channels(ss, No, is_out);
            if (w == 0)
                for (int j = 0; j < p.outlier_channels; j++) {
                    int c = syn.outlier_channel[(3 * H + h) * p.outlier_channels + j];
                    TH_CHECK(is_out[c], "kv head %d: synthetic outlier key channel %d is not among the %d chosen", h,
                             c, No);
                }
            for (int i = 0; i <= T; i++) {
                double n_out = 0, n_rest = 0;
                for (int c = 0; c < D; c++) {
                    double a = xh[(size_t)i * D + c], dd = a - yh[(size_t)i * D + c];
                    meas += dd * dd;
                    if (is_out[c])
                        n_out += a * a;
                    else
                        n_rest += a * a;
                }
                pred += part_error(n_out, t->tq_outlier_bits, prod, No) + part_error(n_rest, t->bits, prod, D - No);
                pred_single += part_error(n_out + n_rest, t->bits, prod, D);
            }
        }
        printf("  %s %s: squared error %.4g, two instances' expectation %.4g (ratio %.3f); one instance at %d bits "
               "would be %.4g\n",
               sp->name, w ? "values (mse)" : "keys (prod)", meas, pred, meas / pred, t->bits, pred_single);
        TH_CHECK(fabs(meas / pred - 1) < 0.10, "%s: squared error %.4g, the two instances' %.4g",
                 w ? "values" : "keys", meas, pred);
    }
    printf("  %s: output vs attention over read_cache %.2g, vs exact attention %.3g\n", sp->name, worst_self,
           worst_exact);
    tu_prompt_step_free(&r);
    kvq_synth_free(&syn);
    kvq_engine_free(e);
    kvq_spec_free(f);
    th_end();
}

/* Theorem 2 through the split: x = [x_out | x_rest] (the outlier part 10x larger), each part its own prod
 * instance (kvq_tqv, the parts' rotations drawn as the engine draws them); the estimate of q.x is the sum of the
 * parts' estimates. Over `mats` seeds (rotations and QJL matrices) of `per` pairs each, the mean error is within
 * three standard errors of 0. */
static void test_unbiased(void)
{
    enum { No = 32, mats = 60, per = 60, N = mats * per };
    th_begin("split prod, %d outlier channels at 3 bits + %d at 2: q.k estimate unbiased over %d pairs", No, D - No, N);
    kvq_rng g;
    kvq_rng_seed(&g, 79, 1);
    double se = 0, se2 = 0;
    for (int m = 0; m < mats && !th_failed(); m++) {
        kvq_tqv tv;
        kvq_rot ro, rr;
        TH_CHECK(kvq_tqv_init(&tv, D, 2, 1, 500 + m, No, 3) == KVQ_OK, "init");
        TH_CHECK(kvq_rot_build_random_stream(&ro, 500 + m, No, KVQ_RNG_STREAM_HAAR_OUT) == KVQ_OK &&
                     kvq_rot_build(&rr, KVQ_ROT_RANDOM, 500 + m, D - No) == KVQ_OK,
                 "rotations");
        for (int i = 0; i < per && !th_failed(); i++) {
            float x[D], q[D], norm, rnorm;
            uint8_t codes[D], signs[D];
            double sq[D], truth = 0, est = 0;
            for (int c = 0; c < D; c++) {
                x[c] = (float)(kvq_rng_normal(&g) * (c < No ? 10 : 1) / sqrt(D));
                q[c] = x[c] + (float)(kvq_rng_normal(&g) / sqrt(D));
                truth += (double)q[c] * x[c];
            }
            kvq_rot_apply(&ro, x, 0), kvq_rot_apply(&ro, q, 0);
            kvq_rot_apply(&rr, x + No, 0), kvq_rot_apply(&rr, q + No, 0);
            for (int j = 0; j < tv.n_parts; j++) {
                const kvq_tq *t = &tv.part[j];
                kvq_tq_quantize(t, x + tv.off[j], codes, &norm, signs, &rnorm);
                kvq_tq_sketch_query(t, q + tv.off[j], sq);
                est += kvq_tq_score(t, q + tv.off[j], sq, codes, norm, signs, rnorm);
            }
            se += est - truth;
            se2 += (est - truth) * (est - truth);
        }
        kvq_rot_free(&ro);
        kvq_rot_free(&rr);
        kvq_tqv_free(&tv);
    }
    double mean = se / N, sd = sqrt(se2 / N - mean * mean), stderr_ = sd / sqrt((double)N);
    printf("  mean error %.5f, standard error %.5f\n", mean, stderr_);
    TH_CHECK(fabs(mean) <= 3 * stderr_, "mean error %.5f, 3 standard errors %.5f", mean, 3 * stderr_);
    th_end();
}

/* A split that leaves no regular channels at the engine's head_dim (the spec names none) is refused with the
 * reason, by the engine and by the accounting alike. */
static void test_dims_refused(void)
{
    th_begin("outlier_channels 64 at head_dim 64: kvq_engine_create and kvq_scheme_account refuse it with the reason");
    kvq_spec *f = tu_spec_text("scheme t { key { bits 2; turboquant prod seed 1; outlier_channels 64 bits 3; } }\n");
    const kvq_scheme *s = f ? kvq_spec_scheme(f, "t") : NULL;
    TH_CHECK(s, "scheme");
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){1, 2, 1, 64};
    kvq_engine *e = NULL;
    char err[256] = "";
    kvq_status st = s ? kvq_engine_create(s, &cfg, &e, err, sizeof err) : KVQ_ERR_INVALID;
    TH_CHECK(st == KVQ_ERR_SHAPE && !e && strstr(err, "outlier_channels 64 leaves no regular channels at head_dim 64"),
             "%s: %s", kvq_status_str(st), err);
    kvq_mem_stats m;
    TH_CHECK(!s || kvq_scheme_account(s, &cfg.dims, 1, 10, NULL, &m) == KVQ_ERR_SHAPE, "account accepted it");
    kvq_engine_free(e);
    kvq_spec_free(f);
    th_end();
}

/* create + two sequences' prefill + 3 decode steps + read_cache of turboquant-2p5 on the reference: the last
 * step's outputs (the split's rotations, per-sequence orders and two-instance quantizers all allocate). */
static kvq_status alloc_scenario(const kvq_scheme *sch, float *out)
{
    enum { H = 2, Hq = 4, T = 40 };
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){1, Hq, H, D};
    kvq_engine *e = NULL;
    char err[256];
    kvq_status st = kvq_engine_create(sch, &cfg, &e, err, sizeof err);
    kvq_seq *sq[2] = {NULL, NULL};
    static float buf[(2 * H + Hq) * T * D], rk[H * (T + 3) * D], rv[H * (T + 3) * D];
    uint64_t rng = tu_rng;
    for (int b = 0; b < 2 && st == KVQ_OK; b++) st = kvq_seq_create(e, &sq[b]);
    for (int b = 0; b < 2 && st == KVQ_OK; b++) {
        tu_fill(buf, sizeof buf / sizeof buf[0], 1.0f);
        kvq_prefill_item it = {sq[b], T - 5 * b, buf, buf + H * (T - 5 * b) * D, NULL};
        st = kvq_prefill(e, 0, &it, 1);
    }
    for (int step = 0; step < 3 && st == KVQ_OK; step++) {
        tu_fill(buf, 2 * (2 * H + Hq) * D, 1.0f);
        kvq_decode_item it[2];
        for (int b = 0; b < 2; b++) {
            float *x = buf + (size_t)b * (2 * H + Hq) * D;
            it[b] = (kvq_decode_item){sq[b], x, x + H * D, x + 2 * H * D, out + (size_t)b * Hq * D};
        }
        st = kvq_decode(e, 0, it, 2);
    }
    int n = 0;
    if (st == KVQ_OK) st = kvq_seq_read_cache(e, sq[1], 0, rk, rv, T + 3, &n);
    tu_rng = rng;
    kvq_engine_free(e);
    return st;
}

static void test_alloc_failures(void)
{
    th_begin("turboquant-2p5 on the reference: allocation failure n = 1, 2, ... through create, prefill, decode and "
             "read_cache: KVQ_ERR_NOMEM, nothing leaked, then the same outputs");
    kvq_spec *f = tu_spec_file("specs/rotate/turboquant-2.5bit.kvq");
    const kvq_scheme *s = f ? kvq_spec_scheme(f, "turboquant-2p5") : NULL;
    static float want[2 * 4 * D], got[2 * 4 * D];
    TH_CHECK(s && alloc_scenario(s, want) == KVQ_OK, "the scenario fails without injection");
    int completed = 0;
    long n;
    for (n = 1; n < 20000 && s && !th_failed(); n++) {
        kvq_alloc_fail_after(n);
        kvq_status st = alloc_scenario(s, got);
        long injected = kvq_alloc_failures();
        kvq_alloc_fail_after(0);
        if (injected == 0) {
            TH_CHECK(st == KVQ_OK && !memcmp(got, want, sizeof got), "n=%ld: the completed run differs (%s)", n,
                     kvq_status_str(st));
            completed = 1;
            break;
        }
        TH_CHECK(st == KVQ_ERR_NOMEM, "n=%ld: an allocation failure gave %s", n, kvq_status_str(st));
    }
    TH_CHECK(completed, "no run completed (n up to %ld)", n);
    printf("  %ld allocations\n", n - 1);
    kvq_spec_free(f);
    th_end();
}

int main(void)
{
    test_alloc_failures();
    test_dims_refused();
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) test_accounting(&specs[i]);
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) test_engine(&specs[i]);
    test_unbiased();
    return th_summary();
}
