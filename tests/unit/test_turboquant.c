/* TurboQuant's claims (arXiv 2504.19874) on the quantizers of runtime/turboquant.c, through kvq's rotation:
 * - Theorem 1: on random unit vectors (D = 128) the MSE variant's mean squared error is within 5% of 0.363,
 *   0.117, 0.0345, 0.0095 at b = 1..4;
 * - Theorem 2: the inner-product variant is unbiased: over many (q, k) pairs and QJL matrices, the mean of
 *   (estimate - q.k) is within three standard errors of 0;
 * - Sec. 1 / Lemma 4's remark: the MSE variant at b = 1 is biased by 2/pi (E<q, k_mse> = (2/pi) <q, k>), which
 *   the same test detects (pairs with q.k near 1, so a multiplicative bias cannot average out). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "harness.h"
#include "rotation.h"
#include "test_engine_util.h"
#include "turboquant.h"

#define D 128

static void unit_vector(kvq_rng *g, float *x)
{
    double n = 0, t[D];
    for (int c = 0; c < D; c++) {
        t[c] = kvq_rng_normal(g);
        n += t[c] * t[c];
    }
    for (int c = 0; c < D; c++) x[c] = (float)(t[c] / sqrt(n));
}

static void test_mse(void)
{
    static const double paper[5] = {0, 0.363, 0.117, 0.0345, 0.0095}; /* Theorem 1 */
    const int N = 6000;
    kvq_rot rot;
    kvq_rng g;
    kvq_rng_seed(&g, 77, 1);
    int ok = kvq_rot_build(&rot, KVQ_ROT_RANDOM, 1, D) == KVQ_OK;
    for (int b = 1; b <= 4; b++) {
        th_begin("TurboQuant MSE, D %d, b = %d: mean squared error on %d random unit vectors within 5%% of %g", D, b,
                 N, paper[b]);
        kvq_tq t;
        TH_CHECK(ok && kvq_tq_init(&t, D, b, 0, 0) == KVQ_OK, "init");
        double sum = 0;
        for (int i = 0; i < N && !th_failed(); i++) {
            float x[D], y[D], xr[D], norm;
            uint8_t codes[D];
            unit_vector(&g, x);
            for (int c = 0; c < D; c++) y[c] = x[c];
            kvq_rot_apply(&rot, y, 0); /* y = Pi x */
            kvq_tq_quantize(&t, y, codes, &norm, NULL, NULL);
            kvq_tq_dequant_mse(&t, codes, norm, xr);
            kvq_rot_apply(&rot, xr, 1); /* Pi^T y~ */
            for (int c = 0; c < D; c++) sum += ((double)x[c] - xr[c]) * ((double)x[c] - xr[c]);
        }
        double mse = sum / N;
        printf("  b = %d: MSE %.5f (paper %.4f, ratio %.3f)\n", b, mse, paper[b], mse / paper[b]);
        TH_CHECK(fabs(mse / paper[b] - 1) <= 0.05, "MSE %.5f", mse);
        kvq_tq_free(&t);
        th_end();
    }
    kvq_rot_free(&rot);
}

/* Pairs: k a random unit vector, q = k + N(0, 0.25/D) noise (q.k near 1). Each of `mats` QJL matrices serves
 * `per` pairs, so the mean is over S as Theorem 2's expectation is. */
static void test_inner_product(void)
{
    const int mats = 160, per = 50, N = mats * per;
    for (int b = 1; b <= 4; b++) {
        int prod = b >= 2;
        th_begin("TurboQuant %s, D %d, b = %d: inner products over %d pairs: %s", prod ? "inner-product" : "MSE", D,
                 b, N, prod ? "mean error within 3 standard errors of 0" : "biased by 2/pi");
        kvq_rng g;
        kvq_rng_seed(&g, 78, (uint64_t)b);
        double se = 0, se2 = 0, sum_est = 0, sum_true = 0;
        for (int m = 0; m < mats && !th_failed(); m++) {
            kvq_tq t;
            TH_CHECK(kvq_tq_init(&t, D, b, prod, 1000 * b + m) == KVQ_OK, "init");
            for (int i = 0; i < per && !th_failed(); i++) {
                float k[D], q[D], norm, rnorm = 0;
                uint8_t codes[D], signs[D];
                double sq[D];
                unit_vector(&g, k);
                double truth = 0;
                for (int c = 0; c < D; c++) {
                    q[c] = k[c] + (float)(0.5 / sqrt(D) * kvq_rng_normal(&g));
                    truth += (double)q[c] * k[c];
                }
                kvq_tq_quantize(&t, k, codes, &norm, signs, &rnorm);
                if (prod) kvq_tq_sketch_query(&t, q, sq);
                double est = kvq_tq_score(&t, q, sq, codes, norm, signs, rnorm);
                /* the materialised key (what the reference backend attends with) gives the same estimate */
                float kd[D];
                double viak = 0;
                kvq_tq_dequant(&t, codes, norm, signs, rnorm, kd);
                for (int c = 0; c < D; c++) viak += (double)q[c] * kd[c];
                TH_CHECK(fabs(viak - est) < 1e-4, "dequantized key: %g, estimator %g", viak, est);
                se += est - truth;
                se2 += (est - truth) * (est - truth);
                sum_est += est;
                sum_true += truth;
            }
            kvq_tq_free(&t);
        }
        double mean = se / N, sd = sqrt(se2 / N - mean * mean), stderr_ = sd / sqrt((double)N);
        double ratio = sum_est / sum_true;
        printf("  b = %d: mean error %.5f, standard error %.5f, E[est] / E[q.k] = %.4f\n", b, mean, stderr_, ratio);
        if (prod)
            TH_CHECK(fabs(mean) <= 3 * stderr_, "mean error %.5f, 3 standard errors %.5f", mean, 3 * stderr_);
        else
            TH_CHECK(fabs(ratio - 2 / M_PI) < 0.01 && fabs(mean) > 3 * stderr_,
                     "E[est] / E[q.k] = %.4f, 2/pi = %.4f (mean error %.4f, standard error %.5f)", ratio, 2 / M_PI,
                     mean, stderr_);
        th_end();
    }
}

/* specs/rotate/turboquant.kvq through the engine on the reference backend: attention over what the cache holds
 * (read_cache) equals the decode output, TurboQuant at 4 + 3 bits stays close to exact attention on structured
 * K/V, the memory equals kvq_scheme_account's; the emulated cuda backend takes these schemes (its numbers:
 * test_cuda_turboquant; the cpu backend's: test_cpu_turboquant). */
static void test_engine(const char *name)
{
    th_begin("engine: %s (specs/rotate/turboquant.kvq) on the reference: decode = attention over read_cache, "
             "stats = kvq_scheme_account; the emu backend takes it",
             name);
    enum { H = 2, Hq = 4, T = 150, L = 1 };
    kvq_spec *sp = tu_spec_file("specs/rotate/turboquant.kvq");
    const kvq_scheme *s = sp ? kvq_spec_scheme(sp, name) : NULL;
    TH_CHECK(s, "scheme %s", name);
    kvq_engine *e = s ? tu_engine(s, L, Hq, H, D, KVQ_F32) : NULL;
    kvq_synth_params p = kvq_synth_params_default();
    p.layers = 4, p.kv_heads = H, p.heads = Hq, p.head_dim = D, p.tokens = T + 1, p.seed = 3;
    kvq_synth syn = {0};
    char err[256];
    TH_CHECK(kvq_synth_generate(&p, &syn, err, sizeof err) == KVQ_OK, "synth: %s", err);
    tu_prompt_step r = {.kv_heads = H, .heads = Hq, .tokens = T, .dim = D};
    if (!th_failed()) tu_prompt_step_run(e, s, &syn, 3, &r); /* layer 3: outlier channels and tokens */
    double worst_self = r.worst_self, worst_exact = r.worst_exact;
    const float *k = r.k, *v = r.v, *rk = r.rk, *rv = r.rv;
    /* Theorem 1 holds for any fixed vector (Pi x / |x| is uniform on the sphere): the stored MSE tensors'
     * relative squared error, averaged over the tokens, is D_mse(b) (the kvq_lloyd_max MSE of N(0, 1)). */
    static const double dmse[5] = {0, 0.3634, 0.1175, 0.03455, 0.0095};
    double rel[2] = {0, 0};
    for (int w = 0; w < 2 && !th_failed(); w++)
        for (int i = 0; i < H * (T + 1); i++) {
            const float *x = (w ? v : k) + (size_t)i * D, *y = (w ? rv : rk) + (size_t)i * D;
            double e2 = 0, n2 = 0;
            for (int c = 0; c < D; c++) {
                e2 += ((double)x[c] - y[c]) * ((double)x[c] - y[c]);
                n2 += (double)x[c] * x[c];
            }
            rel[w] += e2 / n2 / (H * (T + 1));
        }
    printf("  %s: output vs attention over read_cache %.2g, vs exact attention %.3g; relative MSE keys %.4f "
           "values %.4f\n",
           name, worst_self, worst_exact, rel[0], rel[1]);
    TH_CHECK(worst_self < 1e-4, "decode differs from attention over what the cache holds by %.3g", worst_self);
    for (int w = 0; w < 2 && s; w++) {
        const kvq_tensor_cfg *t = w ? &s->base.quant.value : &s->base.quant.key;
        if (t->turboquant != KVQ_TQ_MSE) continue;
        TH_CHECK(fabs(rel[w] / dmse[t->bits] - 1) < 0.1, "%s: relative MSE %.4f, Theorem 1's %.4f at %d bits",
                 w ? "values" : "keys", rel[w], dmse[t->bits], t->bits);
    }
    {
        /* the emulated cuda backend takes it too (its numbers against this backend's: test_cuda_turboquant; the
         * cpu backend's: test_cpu_turboquant); only prod values are refused there */
        kvq_engine_config cfg;
        kvq_engine_config_init(&cfg);
        cfg.dims = (kvq_dims){L, Hq, H, D};
        cfg.backend = KVQ_BACKEND_EMU;
        kvq_engine *x = NULL;
        kvq_status st = s ? kvq_engine_create(s, &cfg, &x, err, sizeof err) : KVQ_ERR_INVALID;
        TH_CHECK(st == KVQ_OK || st == KVQ_ERR_UNAVAILABLE, "emu backend: %s: %s", kvq_status_str(st), err);
        kvq_engine_free(x);
    }
    tu_prompt_step_free(&r);
    kvq_synth_free(&syn);
    kvq_engine_free(e);
    kvq_spec_free(sp);
    th_end();
}

/* Every head_dim kvq supports (the codes of 96 channels at 1-3 bits, the QJL plane): the decode output is
 * attention over what read_cache returns, and the values' distortion is Theorem 1's. */
static void test_head_dims(void)
{
    static const int dims[] = {64, 96, 256};
    for (int di = 0; di < 3; di++) {
        int Dh = dims[di], H = 1, Hq = 2, T = 60;
        th_begin("engine: turboquant prod 3 keys, mse 2 values at head_dim %d: decode = attention over read_cache",
                 Dh);
        kvq_spec *sp = tu_spec_text("scheme t { key { bits 3; turboquant prod seed 4; }\n"
                                    "  value { bits 2; turboquant mse seed 5; } }\n");
        kvq_engine *e = sp ? tu_engine(kvq_spec_scheme(sp, "t"), 1, Hq, H, Dh, KVQ_F32) : NULL;
        kvq_seq *seq = NULL;
        TH_CHECK(e && kvq_seq_create(e, &seq) == KVQ_OK, "engine");
        size_t n = (size_t)H * (T + 1) * Dh;
        float *k = malloc(n * 4), *v = malloc(n * 4), *q = malloc((size_t)Hq * Dh * 4), *out = malloc((size_t)Hq * Dh * 4);
        float *rk = malloc(n * 4), *rv = malloc(n * 4), *ex = malloc((size_t)Dh * 4);
        tu_fill(k, n, 2);
        tu_fill(v, n, 1);
        tu_fill(q, (size_t)Hq * Dh, 1);
        kvq_prefill_item it = {seq, T, k, v, NULL}; /* H = 1: the first T rows */
        TH_CHECK(!th_failed() && kvq_prefill(e, 0, &it, 1) == KVQ_OK, "prefill: %s", kvq_engine_errmsg(e));
        kvq_decode_item d = {seq, k + (size_t)T * Dh, v + (size_t)T * Dh, q, out};
        TH_CHECK(!th_failed() && kvq_decode(e, 0, &d, 1) == KVQ_OK, "decode: %s", kvq_engine_errmsg(e));
        int got = 0;
        TH_CHECK(!th_failed() && kvq_seq_read_cache(e, seq, 0, rk, rv, T + 1, &got) == KVQ_OK && got == T + 1, "read");
        for (int h = 0; h < Hq && !th_failed(); h++) {
            tu_exact_attention(q + (size_t)h * Dh, rk, rv, T + 1, Dh, 1 / sqrt((double)Dh), ex);
            double rel = tu_rel_err(out + (size_t)h * Dh, ex, (size_t)Dh, 1e-3);
            TH_CHECK(rel < 1e-4, "head %d: %.3g from attention over read_cache", h, rel);
        }
        double e2 = 0, n2 = 0;
        for (size_t i = 0; i < n && !th_failed(); i++) {
            e2 += ((double)v[i] - rv[i]) * ((double)v[i] - rv[i]);
            n2 += (double)v[i] * v[i];
        }
        TH_CHECK(fabs(e2 / n2 / 0.1175 - 1) < 0.15, "values' relative MSE %.4f, Theorem 1's 0.1175", e2 / n2);
        free(k), free(v), free(q), free(out), free(rk), free(rv), free(ex);
        kvq_engine_free(e);
        kvq_spec_free(sp);
        th_end();
    }
}

int main(void)
{
    test_head_dims();
    test_mse();
    test_inner_product();
    test_engine("turboquant-k4v3");
    test_engine("turboquant-k3v2");
    test_engine("turboquant-mse3");
    return th_summary();
}
