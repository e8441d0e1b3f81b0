/* Rotations of head vectors: construction and application (rotation.h). */
#include "rotation.h"

#include <math.h>
#include <string.h>

#include "alloc.h"

/* ---- the specified generator ---- */

void kvq_rng_seed(kvq_rng *g, uint64_t stream, uint64_t seed)
{
    g->s = seed * 0x9E3779B97F4A7C15ull ^ stream;
}

uint64_t kvq_rng_next(kvq_rng *g)
{
    /* splitmix64 (Steele, Lea, Flood 2014) */
    uint64_t z = (g->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double kvq_rng_uniform(kvq_rng *g) { return (double)(kvq_rng_next(g) >> 11) * 0x1p-53; }

/* libm's log is not correctly rounded everywhere; this one is a fixed sequence of IEEE operations: x = m 2^e
 * (frexp is exact), m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(t), t = (m - 1) / (m + 1), |t| < 0.172, summed to
 * t^41 (the next term is below 1e-32). */
double kvq_rng_log(double x)
{
    int e;
    double m = frexp(x, &e);
    if (m < 0.70710678118654752440) {
        m *= 2;
        e--;
    }
    double t = (m - 1) / (m + 1), t2 = t * t, term = t, sum = 0;
    for (int k = 1; k <= 41; k += 2) {
        sum += term / k;
        term *= t2;
    }
    return (double)e * 0.69314718055994530942 + 2 * sum;
}

double kvq_rng_normal(kvq_rng *g)
{
    /* Marsaglia's polar method: (u, v) uniform in the unit disc, u * sqrt(-2 ln s / s) is N(0, 1). */
    for (;;) {
        double u = 2 * kvq_rng_uniform(g) - 1, v = 2 * kvq_rng_uniform(g) - 1, s = u * u + v * v;
        if (s > 0 && s < 1) return u * sqrt(-2 * kvq_rng_log(s) / s);
    }
}

/* ---- Hadamard ---- */

/* Paley's first construction for q = 11: H_12 = I + S, S = [[0, 1^T], [-1, Q]], Q[i][j] = chi(j - i) with chi
 * the quadratic character of GF(11) (residues 1, 3, 4, 5, 9). S is skew (q = 3 mod 4), so H H^T = 12 I. */
static int h12(int i, int j)
{
    static const int chi[11] = {0, 1, -1, 1, 1, 1, -1, -1, -1, 1, -1};
    if (i == j) return 1;
    if (i == 0) return 1;
    if (j == 0) return -1;
    return chi[((j - i) % 11 + 11) % 11];
}

/* Sylvester's H_n, n a power of two, in place (the fast Walsh-Hadamard transform; H is symmetric). */
static void fwht(double *x, int n, int stride)
{
    for (int len = 1; len < n; len <<= 1)
        for (int i = 0; i < n; i += len << 1)
            for (int j = i; j < i + len; j++) {
                double a = x[j * stride], b = x[(j + len) * stride];
                x[j * stride] = a + b;
                x[(j + len) * stride] = a - b;
            }
}

/* x <- H x (transpose = 0) or H^T x, H = Sylvester H_D, or H_12 (x) H_8 for D = 96 (index c = 8 i + j). */
static void hadamard(double *x, int D, int transpose)
{
    if (D != 96) {
        fwht(x, D, 1);
        return;
    }
    for (int i = 0; i < 12; i++) fwht(x + 8 * i, 8, 1);
    for (int j = 0; j < 8; j++) {
        double y[12];
        for (int i = 0; i < 12; i++) {
            double s = 0;
            for (int k = 0; k < 12; k++) s += (transpose ? h12(k, i) : h12(i, k)) * x[8 * k + j];
            y[i] = s;
        }
        for (int i = 0; i < 12; i++) x[8 * i + j] = y[i];
    }
}

/* ---- Haar-random ---- */

/* Q of G = QR by modified Gram-Schmidt over G's columns, run twice per column (re-orthogonalisation keeps Q
 * orthogonal to 1e-15 at D = 256); R's diagonal is positive, which makes Q Haar-distributed. G[i][j] is the
 * (i D + j)-th normal draw. m ends row-major: y = m x. */
static kvq_status haar(double *m, int D, int seed, uint64_t stream)
{
    double *q = kvq_malloc((size_t)D * D * sizeof *q); /* column-major: column j at q + j D */
    if (!q) return KVQ_ERR_NOMEM;
    kvq_rng g;
    kvq_rng_seed(&g, stream, (uint64_t)seed);
    for (int i = 0; i < D; i++)
        for (int j = 0; j < D; j++) q[(size_t)j * D + i] = kvq_rng_normal(&g);
    for (int j = 0; j < D; j++) {
        double *v = q + (size_t)j * D;
        for (int pass = 0; pass < 2; pass++)
            for (int k = 0; k < j; k++) {
                const double *u = q + (size_t)k * D;
                double dot = 0;
                for (int i = 0; i < D; i++) dot += u[i] * v[i];
                for (int i = 0; i < D; i++) v[i] -= dot * u[i];
            }
        double nrm = 0;
        for (int i = 0; i < D; i++) nrm += v[i] * v[i];
        nrm = sqrt(nrm);
        for (int i = 0; i < D; i++) v[i] /= nrm;
    }
    for (int i = 0; i < D; i++)
        for (int j = 0; j < D; j++) m[(size_t)i * D + j] = q[(size_t)j * D + i];
    kvq_free(q);
    return KVQ_OK;
}

/* ---- the interface ---- */

static kvq_status build(kvq_rot *r, kvq_rotation kind, int seed, int D, uint64_t stream)
{
    memset(r, 0, sizeof *r);
    if (D < 1 || D > KVQ_ROT_MAX_D) return KVQ_ERR_SHAPE;
    if (kind == KVQ_ROT_HADAMARD) {
        if (D != 64 && D != 96 && D != 128 && D != 256) return KVQ_ERR_SHAPE;
        r->signs = kvq_malloc((size_t)D * sizeof *r->signs);
        if (!r->signs) return KVQ_ERR_NOMEM;
        kvq_rng g;
        kvq_rng_seed(&g, KVQ_RNG_STREAM_SIGNS, (uint64_t)(seed < 0 ? 0 : seed));
        double norm = 1 / sqrt((double)D);
        for (int c = 0; c < D; c++) r->signs[c] = seed < 0 || !(kvq_rng_next(&g) >> 63) ? norm : -norm;
    } else if (kind == KVQ_ROT_RANDOM) {
        r->m = kvq_malloc((size_t)D * D * sizeof *r->m);
        kvq_status st = r->m ? haar(r->m, D, seed, stream) : KVQ_ERR_NOMEM;
        if (st != KVQ_OK) {
            kvq_free(r->m);
            r->m = NULL;
            return st;
        }
    } else {
        return KVQ_ERR_INVALID;
    }
    r->kind = kind;
    r->seed = seed;
    r->D = D;
    return KVQ_OK;
}

kvq_status kvq_rot_build(kvq_rot *r, kvq_rotation kind, int seed, int D)
{
    return build(r, kind, seed, D, KVQ_RNG_STREAM_HAAR);
}

kvq_status kvq_rot_build_random_stream(kvq_rot *r, int seed, int D, uint64_t stream)
{
    return build(r, KVQ_ROT_RANDOM, seed, D, stream);
}

void kvq_rot_free(kvq_rot *r)
{
    if (!r) return;
    kvq_free(r->signs);
    kvq_free(r->m);
    memset(r, 0, sizeof *r);
}

void kvq_rot_apply(const kvq_rot *r, float *x, int inverse)
{
    int D = r->D;
    double a[KVQ_ROT_MAX_D], y[KVQ_ROT_MAX_D];
    for (int c = 0; c < D; c++) a[c] = x[c];
    if (r->kind == KVQ_ROT_HADAMARD) {
        /* R = H diag(s) / sqrt(D), R^T = diag(s) H^T / sqrt(D) */
        if (!inverse)
            for (int c = 0; c < D; c++) a[c] *= r->signs[c];
        hadamard(a, D, inverse);
        if (inverse)
            for (int c = 0; c < D; c++) a[c] *= r->signs[c];
        for (int c = 0; c < D; c++) x[c] = (float)a[c];
        return;
    }
    for (int i = 0; i < D; i++) {
        double s = 0;
        if (!inverse)
            for (int j = 0; j < D; j++) s += r->m[(size_t)i * D + j] * a[j];
        else
            for (int j = 0; j < D; j++) s += r->m[(size_t)j * D + i] * a[j];
        y[i] = s;
    }
    for (int c = 0; c < D; c++) x[c] = (float)y[c];
}
