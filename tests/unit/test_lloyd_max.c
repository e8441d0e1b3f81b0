/* Lloyd-Max levels for the normal distribution (base/lloyd_max.h) against the published figures: the MSE for
 * N(0,1) at 1-4 bits (Max 1960 Table I: 0.3634, 0.1175, 0.03454, 0.009497) and Max's levels; against the same
 * quantizers solved independently to 30 digits (mpmath, Lloyd's iteration run to convergence): Max's 3- and 4-bit
 * errors are off in their last digit (0.0345478 and 0.0095010 exactly), so the published figures are held to 0.05 %
 * and the exact ones to 1e-9; the optimality conditions at every bit width; the scaling to N(0, sigma^2) and N(0, 1/D); the MSE
 * integral against a brute-force numerical integration; bad arguments. */
#include "harness.h"
#include "lloyd_max.h"

#include <math.h>

/* Brute-force E[(X - q(X))^2] for X ~ N(0, sigma^2): midpoint rule on [-12 sigma, 12 sigma]. */
static double brute_mse(const double *lv, int n, double sigma)
{
    const int steps = 2000000;
    double lo = -12 * sigma, h = 24 * sigma / steps, sum = 0;
    for (int k = 0; k < steps; k++) {
        double x = lo + (k + 0.5) * h, best = INFINITY;
        for (int i = 0; i < n; i++) {
            double d = (x - lv[i]) * (x - lv[i]);
            if (d < best) best = d;
        }
        double z = x / sigma;
        sum += best * exp(-0.5 * z * z);
    }
    return sum * h / (sigma * sqrt(2 * M_PI));
}

int main(void)
{
    static const double ref_mse[4] = {0.3634, 0.1175, 0.03454, 0.009497};
    /* mpmath, 30 digits: 1 - 2/pi, then the 4-, 8- and 16-level optima. */
    static const double exact_mse[4] = {0.3633802276, 0.1174818478, 0.03454776079, 0.009501008008};
    /* Max 1960, Table I: the positive levels at 1-4 bits (4 significant digits). */
    static const double max_levels[4][8] = {
        {0.7979},
        {0.4528, 1.510},
        {0.2451, 0.7560, 1.344, 2.152},
        {0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733},
    };
    double lv[1 << KVQ_LLOYD_MAX_BITS], mse;

    th_begin("lloyd_max.published_mse_and_levels");
    for (int b = 1; b <= 4; b++) {
        TH_CHECK(kvq_lloyd_max_normal(b, 1.0, lv, &mse) == 0, "bits %d refused", b);
        TH_CHECK(fabs(mse - ref_mse[b - 1]) <= 5e-4 * ref_mse[b - 1], "bits %d: mse %.7f, published %g", b, mse,
                 ref_mse[b - 1]);
        TH_CHECK(fabs(mse - exact_mse[b - 1]) <= 1e-9, "bits %d: mse %.12f, exact %.12f", b, mse, exact_mse[b - 1]);
        int n = 1 << b, m = n / 2;
        for (int i = 0; i < m; i++) {
            double want = max_levels[b - 1][i], got = lv[m + i];
            TH_CHECK(fabs(got - want) <= 0.0006 * want, "bits %d level %d: %.6f, Max %.4f", b, i, got, want);
        }
    }
    th_end();

    th_begin("lloyd_max.optimality_conditions");
    for (int b = 1; b <= KVQ_LLOYD_MAX_BITS; b++) {
        int n = 1 << b;
        TH_CHECK(kvq_lloyd_max_normal(b, 1.0, lv, &mse) == 0, "bits %d refused", b);
        for (int i = 0; i < n; i++) {
            TH_CHECK(lv[i] == -lv[n - 1 - i], "bits %d: not symmetric at %d", b, i);
            if (i) TH_CHECK(lv[i] > lv[i - 1], "bits %d: not ascending at %d", b, i);
        }
        /* A stationary point: moving any one level either way by a little does not lower the MSE. */
        for (int i = n / 2; i < n; i += (n > 16 ? 7 : 1)) {
            double keep = lv[i];
            for (int s = -1; s <= 1; s += 2) {
                lv[i] = keep + s * 1e-4;
                double moved = kvq_normal_quant_mse(lv, n, 1.0);
                TH_CHECK(moved >= mse, "bits %d: moving level %d by %g lowers the mse (%.12g < %.12g)", b, i,
                         s * 1e-4, moved, mse);
            }
            lv[i] = keep;
        }
        /* Each extra bit cuts the error; the high-resolution limit is ~ (sqrt(3) pi / 2) 4^-b (Panter-Dite). */
        double pd = sqrt(3.0) * M_PI / 2 * pow(4.0, -b);
        TH_CHECK(mse < pd && mse > 0.5 * pd, "bits %d: mse %g, Panter-Dite %g", b, mse, pd);
    }
    th_end();

    th_begin("lloyd_max.mse_integral_matches_brute_force");
    {
        static const double odd[5] = {-1.7, -0.3, 0.1, 0.9, 2.5}; /* any level set, not only optimal ones */
        double a = kvq_normal_quant_mse(odd, 5, 1.3), r = brute_mse(odd, 5, 1.3);
        TH_CHECK(fabs(a - r) < 1e-9 * r + 1e-12, "odd levels: %.12g, brute force %.12g", a, r);
        kvq_lloyd_max_normal(3, 1.0, lv, &mse);
        r = brute_mse(lv, 8, 1.0);
        TH_CHECK(fabs(mse - r) < 1e-9, "3-bit: %.12g, brute force %.12g", mse, r);
    }
    th_end();

    th_begin("lloyd_max.scaling_sigma_and_dim");
    {
        double unit[16], mu;
        kvq_lloyd_max_normal(4, 1.0, unit, &mu);
        TH_CHECK(kvq_lloyd_max_normal(4, 0.25, lv, &mse) == 0, "sigma 0.25 refused");
        for (int i = 0; i < 16; i++) TH_CHECK(fabs(lv[i] - 0.25 * unit[i]) < 1e-14, "sigma: level %d", i);
        TH_CHECK(fabs(mse - mu / 16) < 1e-15, "sigma: mse %g, want %g", mse, mu / 16);
        TH_CHECK(kvq_lloyd_max_normal_dim(4, 128, lv, &mse) == 0, "dim 128 refused");
        for (int i = 0; i < 16; i++)
            TH_CHECK(fabs(lv[i] - unit[i] / sqrt(128.0)) < 1e-14, "dim: level %d", i);
        TH_CHECK(fabs(mse * 128 - mu) < 1e-13, "dim: mse*128 %g, want %g", mse * 128, mu);
    }
    th_end();

    th_begin("lloyd_max.bad_arguments");
    TH_CHECK(kvq_lloyd_max_normal(0, 1.0, lv, &mse) == -1, "bits 0 accepted");
    TH_CHECK(kvq_lloyd_max_normal(KVQ_LLOYD_MAX_BITS + 1, 1.0, lv, &mse) == -1, "bits 9 accepted");
    TH_CHECK(kvq_lloyd_max_normal(2, 0.0, lv, &mse) == -1, "sigma 0 accepted");
    TH_CHECK(kvq_lloyd_max_normal(2, NAN, lv, &mse) == -1, "sigma NaN accepted");
    TH_CHECK(kvq_lloyd_max_normal(2, INFINITY, lv, &mse) == -1, "sigma inf accepted");
    TH_CHECK(kvq_lloyd_max_normal(2, 1.0, NULL, &mse) == -1, "NULL levels accepted");
    TH_CHECK(kvq_lloyd_max_normal_dim(2, 0, lv, &mse) == -1, "dim 0 accepted");
    TH_CHECK(kvq_lloyd_max_normal(2, 1.0, lv, NULL) == 0, "NULL mse refused");
    th_end();
    return th_summary();
}
