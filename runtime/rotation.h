/* Orthogonal rotations of head vectors (docs/language.md, "Rotations"): the matrices `rotate hadamard [seed S]`
 * and `rotate random seed S` name, built the same way on every machine, and their application to one vector.
 *
 * - Hadamard (QuaRot, SpinQuant): R = H diag(s) / sqrt(D). H is Sylvester's Walsh-Hadamard matrix for D = 64,
 *   128, 256 (applied by the fast transform, O(D log D)); for D = 96 it is H_12 (x) H_8, H_12 from Paley's first
 *   construction over GF(11) (a true Hadamard matrix of order 96, so every channel mixes with every other;
 *   O(D (12 + log 8))). s = +1 everywhere without a seed, else seeded random signs.
 * - Random (TurboQuant Sec. 3): a Haar-distributed orthogonal matrix, the Q of a QR factorisation of a D x D
 *   matrix of independent N(0, 1) draws (Gram-Schmidt, R's diagonal positive: Mezzadri 2007), O(D^2) to apply.
 *
 * The generator is part of the language (kvq_rng_* below): splitmix64 for bits, Marsaglia's polar method for
 * normals, a logarithm of our own, and Gram-Schmidt in double. Every step is an IEEE-754 double +, -, *, / or
 * sqrt (the build has -ffp-contract=off), so every conforming machine builds the same bits; a unit test pins
 * entries of a matrix to their values. */
#ifndef KVQ_ROTATION_H
#define KVQ_ROTATION_H

#include <stddef.h>
#include <stdint.h>

#include "kvq.h"
#include "scheme.h"

#define KVQ_ROT_MAX_D 256

typedef struct kvq_rot {
    kvq_rotation kind;
    int seed; /* hadamard: -1 = no signs */
    int D;
    double *signs; /* hadamard: [D] +-1 / sqrt(D) (the normalisation folded in) */
    double *m;     /* random: [D][D] row-major, y = m x */
} kvq_rot;

/* Builds the rotation of `kind` (not NONE) and `seed` for vectors of D (64, 96, 128 or 256; random: 1..256).
 * KVQ_ERR_NOMEM or KVQ_ERR_SHAPE (a Hadamard size without a construction) with r zeroed. */
kvq_status kvq_rot_build(kvq_rot *r, kvq_rotation kind, int seed, int D);
/* A random rotation drawn from generator stream `stream` (kvq_rot_build: KVQ_RNG_STREAM_HAAR). */
kvq_status kvq_rot_build_random_stream(kvq_rot *r, int seed, int D, uint64_t stream);
void kvq_rot_free(kvq_rot *r);
/* x <- R x (inverse = 0) or x <- R^T x (inverse = 1), in place, computed in double. */
void kvq_rot_apply(const kvq_rot *r, float *x, int inverse);

/* The specified generator. kvq_rng_seed(stream, seed) starts the stream of one use (stream: a constant that
 * names the use, so two uses of one seed draw different numbers). */
typedef struct {
    uint64_t s;
} kvq_rng;
void kvq_rng_seed(kvq_rng *g, uint64_t stream, uint64_t seed);
uint64_t kvq_rng_next(kvq_rng *g);   /* splitmix64 */
double kvq_rng_uniform(kvq_rng *g);  /* in [0, 1): the top 53 bits */
double kvq_rng_normal(kvq_rng *g);   /* N(0, 1), Marsaglia polar; consumes pairs, keeps no spare */
double kvq_rng_log(double x);        /* natural log for x > 0 by range reduction and atanh series */

#define KVQ_RNG_STREAM_SIGNS 0x5349474e53ull  /* Hadamard signs */
#define KVQ_RNG_STREAM_HAAR 0x48414152ull     /* random rotation */
#define KVQ_RNG_STREAM_QJL 0x514a4cull        /* TurboQuant's QJL matrix */
#define KVQ_RNG_STREAM_HAAR_OUT 0x484141524full /* TurboQuant's outlier-channel instance: its rotation ... */
#define KVQ_RNG_STREAM_QJL_OUT 0x514a4c4full    /* ... and its QJL matrix (turboquant.h, kvq_tqv) */

#endif
