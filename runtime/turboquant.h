/* TurboQuant (Zandieh, Daliri, Hadian, Mirrokni; arXiv 2504.19874): vector quantizers of head vectors that are
 * already rotated (the random rotation Pi of the paper is `rotate random seed S`, applied by the engine,
 * runtime/rt_rotate.c). For a vector y = Pi x of dimension D:
 *
 * - MSE variant (Algorithm 1, Q_mse): the norm ||y|| is stored; each coordinate of the unit vector y / ||y|| is
 *   replaced by the nearest of the 2^b Lloyd-Max levels of N(0, 1/D) (base/lloyd_max.h), the large-D law of one
 *   coordinate of a random unit vector (Lemma 1). Reconstruction: ||y|| * c[idx]. Theorem 1: for unit x the mean
 *   squared error is about 0.363, 0.117, 0.0345, 0.0095 at b = 1..4 (the Lloyd-Max errors of N(0, 1)).
 * - Inner-product variant (Algorithm 2, Q_prod) at b bits: Q_mse at b - 1 bits, then the residual
 *   r = y - y_mse is sketched by QJL (Definition 1): the signs of S r for an m x D matrix S of independent N(0, 1)
 *   draws (m = D, seeded: kvq_rng stream QJL, rotation.h) and gamma = ||r||. Decoding a key adds the QJL estimate
 *   of <q, r>:  <q, y> ~ <q, y_mse> + gamma * sqrt(pi/2) / m * <S q, sign(S r)>, unbiased over S (Theorem 2).
 *   S q is computed once per query (per step and head), so a score adds m sign-products per token.
 *
 * At b = 1 the MSE variant is biased for inner products: E<q, y_mse> = (2/pi) <q, y> (the paper's motivation for
 * Q_prod); test_turboquant shows both. */
#ifndef KVQ_TURBOQUANT_H
#define KVQ_TURBOQUANT_H

#include <stdint.h>

#include "kvq.h"

#define KVQ_TQ_MAX_LEVELS 16 /* MSE bits 1..4 */

typedef struct {
    int D, bits;     /* bits: of the whole quantizer (prod: bits - 1 MSE + 1 QJL) */
    int prod;        /* 1: inner-product variant */
    int mse_bits;    /* bits of the MSE part */
    int m;           /* QJL rows (= D) */
    double levels[KVQ_TQ_MAX_LEVELS]; /* Lloyd-Max levels of N(0, 1/D), ascending */
    double bounds[KVQ_TQ_MAX_LEVELS]; /* midpoints between consecutive levels */
    double *S;       /* prod: [m][D] row-major */
} kvq_tq;

/* bits: MSE 1..4, prod 2..5; D 1..256; seed: S's (prod). KVQ_ERR_INVALID / KVQ_ERR_NOMEM with t zeroed. */
kvq_status kvq_tq_init(kvq_tq *t, int D, int bits, int prod, int seed);
/* The same with S drawn from generator stream `stream` (kvq_tq_init: KVQ_RNG_STREAM_QJL). */
kvq_status kvq_tq_init_stream(kvq_tq *t, int D, int bits, int prod, int seed, uint64_t stream);
void kvq_tq_free(kvq_tq *t);

/* Quantizes y [D]: codes [D] (level indices), *norm = ||y||; prod also signs [m] (1 for S r >= 0, else 0) and
 * *rnorm = ||r|| (signs and rnorm may be NULL for MSE). */
void kvq_tq_quantize(const kvq_tq *t, const float *y, uint8_t *codes, float *norm, uint8_t *signs, float *rnorm);
/* The MSE reconstruction ||y|| c[idx] (prod: of the b - 1 bit part). */
void kvq_tq_dequant_mse(const kvq_tq *t, const uint8_t *codes, float norm, float *out);
/* S q [m] for the estimator (once per query). */
void kvq_tq_sketch_query(const kvq_tq *t, const float *q, double *sq);
/* The inner-product estimate of <q, y> from what is stored: <q, y_mse> (+ the QJL term for prod). */
double kvq_tq_score(const kvq_tq *t, const float *q, const double *sq, const uint8_t *codes, float norm,
                    const uint8_t *signs, float rnorm);
/* Prod: the vector whose inner product with any q is kvq_tq_score: y_mse + rnorm sqrt(pi/2)/m S^T (2 sign - 1)
 * (Algorithm 2's DeQuant_prod). MSE: kvq_tq_dequant_mse. */
void kvq_tq_dequant(const kvq_tq *t, const uint8_t *codes, float norm, const uint8_t *signs, float rnorm, float *out);

/* TurboQuant's outlier channel split (Sec. 4.3: "splitting channels into outlier and non-outlier sets, and
 * applying two independent instances of TurboQuant to each"; 2.5 bits = 32 channels at 3 bits + 96 at 2). The
 * engine (rt_rotate.c) permutes a head vector's outlier channels to the front and rotates each part by its own
 * random matrix, so a stored vector is [outlier part (n_out coordinates) | regular part]; each part has its own
 * norm, codes, and for prod its residual norm and QJL signs (m = the part's dimension). The regular part uses the
 * tensor's seed and the streams of kvq_tq_init / `rotate random`; the outlier part the same seed on streams
 * KVQ_RNG_STREAM_HAAR_OUT / KVQ_RNG_STREAM_QJL_OUT, so the two instances are independent. Without a split there is
 * one part, the whole vector. */
typedef struct {
    int D, n_parts;
    int off[2];     /* first coordinate of each part */
    kvq_tq part[2]; /* [0]: the outlier part when split, else the whole vector */
} kvq_tqv;

/* n_out: 0 or a multiple of 32 below D; out_bits: the outlier instance's bits (as bits). */
kvq_status kvq_tqv_init(kvq_tqv *v, int D, int bits, int prod, int seed, int n_out, int out_bits);
void kvq_tqv_free(kvq_tqv *v);

#endif
