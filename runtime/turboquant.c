/* TurboQuant's quantizers on rotated vectors (turboquant.h). */
#include "turboquant.h"

#include <math.h>
#include <string.h>

#include "alloc.h"
#include "lloyd_max.h"
#include "rotation.h"

kvq_status kvq_tq_init(kvq_tq *t, int D, int bits, int prod, int seed)
{
    return kvq_tq_init_stream(t, D, bits, prod, seed, KVQ_RNG_STREAM_QJL);
}

kvq_status kvq_tq_init_stream(kvq_tq *t, int D, int bits, int prod, int seed, uint64_t stream)
{
    memset(t, 0, sizeof *t);
    int mb = prod ? bits - 1 : bits;
    if (D < 1 || D > 256 || mb < 1 || mb > 4 || seed < 0) return KVQ_ERR_INVALID;
    if (kvq_lloyd_max_normal_dim(mb, D, t->levels, NULL) != 0) return KVQ_ERR_INVALID;
    int n = 1 << mb;
    for (int i = 0; i + 1 < n; i++) t->bounds[i] = (t->levels[i] + t->levels[i + 1]) / 2;
    if (prod) {
        t->S = kvq_malloc((size_t)D * D * sizeof *t->S);
        if (!t->S) {
            memset(t, 0, sizeof *t);
            return KVQ_ERR_NOMEM;
        }
        kvq_rng g;
        kvq_rng_seed(&g, stream, (uint64_t)seed);
        for (size_t i = 0; i < (size_t)D * D; i++) t->S[i] = kvq_rng_normal(&g);
    }
    t->D = D;
    t->bits = bits;
    t->prod = prod;
    t->mse_bits = mb;
    t->m = D;
    return KVQ_OK;
}

void kvq_tq_free(kvq_tq *t)
{
    if (!t) return;
    kvq_free(t->S);
    memset(t, 0, sizeof *t);
}

/* Index of the nearest level: the number of cell bounds below u (ties to the upper cell). */
static uint8_t nearest(const kvq_tq *t, double u)
{
    int n = 1 << t->mse_bits, i = 0;
    while (i + 1 < n && u >= t->bounds[i]) i++;
    return (uint8_t)i;
}

void kvq_tq_dequant_mse(const kvq_tq *t, const uint8_t *codes, float norm, float *out)
{
    for (int c = 0; c < t->D; c++) out[c] = (float)((double)norm * t->levels[codes[c]]);
}

void kvq_tq_quantize(const kvq_tq *t, const float *y, uint8_t *codes, float *norm, uint8_t *signs, float *rnorm)
{
    int D = t->D;
    double nn = 0;
    for (int c = 0; c < D; c++) nn += (double)y[c] * y[c];
    nn = sqrt(nn);
    /* Algorithm 1: idx_j = argmin_k |y_j - c_k| on the unit vector (a zero vector: every code the middle one,
     * norm 0, so it reconstructs exactly) */
    for (int c = 0; c < D; c++) codes[c] = nearest(t, nn > 0 ? y[c] / nn : 0.0);
    *norm = (float)nn;
    if (!t->prod || !signs || !rnorm) return;
    /* Algorithm 2: r = y - DeQuant_mse(idx), qjl = sign(S r), gamma = ||r|| */
    float ym[256];
    double r[256], rr = 0;
    kvq_tq_dequant_mse(t, codes, *norm, ym);
    for (int c = 0; c < D; c++) {
        r[c] = (double)y[c] - ym[c];
        rr += r[c] * r[c];
    }
    for (int i = 0; i < t->m; i++) {
        double s = 0;
        for (int c = 0; c < D; c++) s += t->S[(size_t)i * D + c] * r[c];
        signs[i] = s >= 0;
    }
    *rnorm = (float)sqrt(rr);
}

void kvq_tq_sketch_query(const kvq_tq *t, const float *q, double *sq)
{
    for (int i = 0; i < t->m; i++) {
        double s = 0;
        for (int c = 0; c < t->D; c++) s += t->S[(size_t)i * t->D + c] * q[c];
        sq[i] = s;
    }
}

double kvq_tq_score(const kvq_tq *t, const float *q, const double *sq, const uint8_t *codes, float norm,
                    const uint8_t *signs, float rnorm)
{
    double s = 0;
    for (int c = 0; c < t->D; c++) s += (double)q[c] * ((double)norm * t->levels[codes[c]]);
    if (!t->prod) return s;
    /* QJL (Definition 1 / Lemma 3): <q, r> ~ sqrt(pi/2) / m * ||r|| * <S q, sign(S r)> */
    double j = 0;
    for (int i = 0; i < t->m; i++) j += signs[i] ? sq[i] : -sq[i];
    return s + (double)rnorm * sqrt(M_PI / 2) / t->m * j;
}

void kvq_tq_dequant(const kvq_tq *t, const uint8_t *codes, float norm, const uint8_t *signs, float rnorm, float *out)
{
    int D = t->D;
    double acc[256];
    for (int c = 0; c < D; c++) acc[c] = (double)norm * t->levels[codes[c]];
    if (t->prod) {
        double g = (double)rnorm * sqrt(M_PI / 2) / t->m;
        for (int i = 0; i < t->m; i++) {
            double z = signs[i] ? g : -g;
            for (int c = 0; c < D; c++) acc[c] += z * t->S[(size_t)i * D + c];
        }
    }
    for (int c = 0; c < D; c++) out[c] = (float)acc[c];
}

kvq_status kvq_tqv_init(kvq_tqv *v, int D, int bits, int prod, int seed, int n_out, int out_bits)
{
    memset(v, 0, sizeof *v);
    if (n_out < 0 || n_out >= D || n_out % 32) return KVQ_ERR_INVALID;
    kvq_status st = KVQ_OK;
    if (n_out > 0) {
        st = kvq_tq_init_stream(&v->part[0], n_out, out_bits, prod, seed, KVQ_RNG_STREAM_QJL_OUT);
        if (st == KVQ_OK) st = kvq_tq_init(&v->part[1], D - n_out, bits, prod, seed);
        v->off[1] = n_out;
        v->n_parts = 2;
    } else {
        st = kvq_tq_init(&v->part[0], D, bits, prod, seed);
        v->n_parts = 1;
    }
    v->D = D;
    if (st != KVQ_OK) kvq_tqv_free(v);
    return st;
}

void kvq_tqv_free(kvq_tqv *v)
{
    if (!v) return;
    kvq_tq_free(&v->part[0]);
    kvq_tq_free(&v->part[1]);
    memset(v, 0, sizeof *v);
}
