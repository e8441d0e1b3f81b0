/* Lloyd-Max levels for N(0, sigma^2): see lloyd_max.h. Works on the standard normal and scales at the end.
 * The levels are symmetric, so only the positive half is iterated (cells [t_i, t_{i+1}) with t_0 = 0, t_m = inf);
 * the cell integrals use erfc of non-negative arguments, which keeps full relative precision in the tails. */
#include "lloyd_max.h"

#include <math.h>
#include <stddef.h>

#define SQRT1_2 0.70710678118654752440
#define INV_SQRT_2PI 0.39894228040143267794

static double pdf(double x) { return isinf(x) ? 0.0 : INV_SQRT_2PI * exp(-0.5 * x * x); }

/* Upper tail P(X > x). */
static double upper(double x) { return 0.5 * erfc(x * SQRT1_2); }

/* P(a < X < b), precise whichever side of 0 the cell lies. */
static double cell_prob(double a, double b)
{
    if (a >= 0) return upper(a) - upper(b);
    if (b <= 0) return upper(-b) - upper(-a);
    return 1.0 - upper(-a) - upper(b);
}

/* x * pdf(x), 0 at the infinities. */
static double xpdf(double x) { return isinf(x) ? 0.0 : x * pdf(x); }

/* The inverse of upper() on (0, 0.5]: bisection, which is all the start needs (it runs once per level). */
static double upper_inv(double p)
{
    double lo = 0, hi = 40;
    for (int i = 0; i < 200; i++) {
        double mid = 0.5 * (lo + hi);
        if (upper(mid) > p)
            lo = mid;
        else
            hi = mid;
    }
    return 0.5 * (lo + hi);
}

double kvq_normal_quant_mse(const double *levels, int n, double sigma)
{
    if (n < 1 || !(sigma > 0)) return NAN;
    double sum = 0;
    for (int i = 0; i < n; i++) {
        double c = levels[i] / sigma;
        double a = i == 0 ? -INFINITY : 0.5 * (levels[i - 1] + levels[i]) / sigma;
        double b = i == n - 1 ? INFINITY : 0.5 * (levels[i] + levels[i + 1]) / sigma;
        double p = cell_prob(a, b);
        double m1 = pdf(a) - pdf(b);              /* E[X; a<X<b] */
        double m2 = p + xpdf(a) - xpdf(b);        /* E[X^2; a<X<b] */
        sum += m2 - 2 * c * m1 + c * c * p;
    }
    return sum * sigma * sigma;
}

int kvq_lloyd_max_normal(int bits, double sigma, double *levels, double *mse)
{
    if (bits < 1 || bits > KVQ_LLOYD_MAX_BITS || !isfinite(sigma) || !(sigma > 0) || !levels) return -1;
    int n = 1 << bits, m = n / 2;
    double c[1 << (KVQ_LLOYD_MAX_BITS - 1)];
    /* Start at the high-resolution optimum (Panter & Dite 1951: level density proportional to pdf^(1/3), i.e.
     * the quantiles of N(0, 3)), which is close enough that the iteration below takes tens of steps, not
     * thousands, even at 8 bits. */
    for (int i = 0; i < m; i++) c[i] = sqrt(3.0) * upper_inv(0.5 - (i + 0.5) / n);
    /* Lloyd's iteration: boundaries at midpoints, levels at the cells' conditional means. The MSE falls
     * monotonically; stop when no level moves by more than a few ulps. */
    for (int it = 0; it < 100000; it++) {
        double moved = 0;
        for (int i = 0; i < m; i++) {
            double a = i == 0 ? 0.0 : 0.5 * (c[i - 1] + c[i]);
            double b = i == m - 1 ? INFINITY : 0.5 * (c[i] + c[i + 1]);
            double nc = (pdf(a) - pdf(b)) / cell_prob(a, b);
            double d = fabs(nc - c[i]);
            if (d > moved) moved = d;
            c[i] = nc;
        }
        if (moved <= 1e-15) break;
    }
    for (int i = 0; i < m; i++) {
        levels[m + i] = c[i] * sigma;
        levels[m - 1 - i] = -c[i] * sigma;
    }
    if (mse) *mse = kvq_normal_quant_mse(levels, n, sigma);
    return 0;
}

int kvq_lloyd_max_normal_dim(int bits, int dim, double *levels, double *mse)
{
    if (dim < 1) return -1;
    return kvq_lloyd_max_normal(bits, 1.0 / sqrt((double)dim), levels, mse);
}
