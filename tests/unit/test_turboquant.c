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

int main(void)
{
    test_mse();
    test_inner_product();
    return th_summary();
}
