/* Lloyd-Max quantizer levels for a normal distribution: the 2^bits reconstruction levels that minimise the mean
 * squared error of N(0, sigma^2) (Lloyd 1982 / Max 1960: each level is the conditional mean of its cell, each
 * cell boundary the midpoint of its two levels). Pure numerics, no kvq types: the compiler's `codebook normal`
 * and TurboQuant's per-coordinate codebook (which quantizes the coordinates of a randomly rotated unit vector,
 * distributed about N(0, 1/D)) both take their levels from here.
 *
 * Reference figures (Max 1960, Table I): the MSE for N(0,1) is 0.3634, 0.1175, 0.03454 and 0.009497 at 1, 2, 3
 * and 4 bits. Solved to convergence (here, and independently in 30-digit arithmetic) the 3- and 4-bit optima are
 * 0.0345478 and 0.0095010: Max's table is off in its last digit there (tests/unit/test_lloyd_max.c holds both).
 * For N(0, sigma^2) the levels scale by sigma and the MSE by sigma^2. */
#ifndef KVQ_LLOYD_MAX_H
#define KVQ_LLOYD_MAX_H

#define KVQ_LLOYD_MAX_BITS 8 /* the most bits the solver accepts (256 levels) */

/* Levels for N(0, sigma^2) at `bits` bits (1..KVQ_LLOYD_MAX_BITS), ascending, written to levels[0 .. 2^bits).
 * The levels are symmetric about 0 (levels[i] == -levels[n-1-i] exactly). *mse (if not NULL) gets the mean
 * squared error of the quantizer for that distribution. Returns 0, or -1 for bits out of range or sigma not
 * finite and positive (nothing written). Deterministic: the same answer on every host with an IEEE libm. */
int kvq_lloyd_max_normal(int bits, double sigma, double *levels, double *mse);

/* TurboQuant's case: N(0, 1/dim), the distribution of one coordinate of a random unit vector in R^dim
 * (TurboQuant Lemma 1, the large-dim limit of its Beta distribution). Same contract as kvq_lloyd_max_normal;
 * -1 also for dim < 1. */
int kvq_lloyd_max_normal_dim(int bits, int dim, double *levels, double *mse);

/* The mean squared error of quantizing N(0, sigma^2) to the nearest of levels[0 .. n) (ascending, n >= 1):
 * exact integration cell by cell, for any level set (a trained one, or an explicit codebook). */
double kvq_normal_quant_mse(const double *levels, int n, double sigma);

#endif
