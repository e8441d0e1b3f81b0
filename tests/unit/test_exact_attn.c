/* kvq_exact_attention_many (runtime/exact_attn.h), the threaded exact-attention baseline of kvq eval: for any
 * thread count its outputs are bit-identical to kvq_exact_attention called job by job in order, over jobs of
 * different lengths (1 to a few hundred tokens, the causal rows eval computes), head_dim 64/96/128/256 and a
 * row stride wider than head_dim; every job is computed exactly once (outputs start as NaN, none stays). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exact_attn.h"
#include "harness.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float frand(void)
{
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return (float)((double)((rng * 0x2545F4914F6CDD1Dull) >> 40) / (double)(1u << 23) - 1.0) * 3.0f;
}

static void check_dims(int D, long stride, int n_jobs)
{
    int T = 300;
    float *k = malloc((size_t)T * stride * sizeof(float)), *v = malloc((size_t)T * stride * sizeof(float));
    float *q = malloc((size_t)n_jobs * D * sizeof(float));
    float *want = malloc((size_t)n_jobs * D * sizeof(float)), *got = malloc((size_t)n_jobs * D * sizeof(float));
    kvq_exact_job *jobs = malloc((size_t)n_jobs * sizeof *jobs);
    TH_CHECK(k && v && q && want && got && jobs, "out of memory");
    if (th_failed()) goto out;
    for (long i = 0; i < T * stride; i++) k[i] = frand(), v[i] = frand();
    for (long i = 0; i < (long)n_jobs * D; i++) q[i] = frand();
    float scale = 1.0f / sqrtf((float)D);
    for (int j = 0; j < n_jobs; j++) {
        /* Lengths 1..T in a scrambled order: jobs of very different cost side by side. */
        int n = 1 + (int)((j * 7919L) % T);
        jobs[j] = (kvq_exact_job){q + (size_t)j * D, k, v, n, got + (size_t)j * D};
        kvq_exact_attention(q + (size_t)j * D, k, v, n, D, stride, scale, want + (size_t)j * D);
    }
    int threads[] = {1, 2, 3, 5, 16, 0};
    for (size_t t = 0; t < sizeof threads / sizeof threads[0]; t++) {
        for (long i = 0; i < (long)n_jobs * D; i++) got[i] = NAN;
        kvq_exact_attention_many(jobs, (size_t)n_jobs, D, stride, scale, threads[t]);
        size_t diff = 0, first = 0;
        for (size_t i = 0; i < (size_t)n_jobs * D; i++)
            if (memcmp(&got[i], &want[i], sizeof(float)) && !diff++) first = i;
        TH_CHECK(diff == 0, "D %d stride %ld, %d jobs, %d threads: %zu outputs differ from the single-threaded ones "
                 "(first: job %zu channel %zu, %.9g vs %.9g)", D, stride, n_jobs, threads[t], diff, first / D,
                 first % D, (double)got[first], (double)want[first]);
    }
out:
    free(k), free(v), free(q), free(want), free(got), free(jobs);
}

int main(void)
{
    int dims[] = {64, 96, 128, 256};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++) {
        th_begin("exact attention, threaded: head_dim %d bit-identical to one thread (1..16 threads)", dims[i]);
        check_dims(dims[i], dims[i], 97);
        th_end();
    }
    th_begin("exact attention, threaded: row stride 3x head_dim (GQA rows of one buffer), 1 job and 200 jobs");
    check_dims(128, 384, 1);
    check_dims(128, 384, 200);
    th_end();
    th_begin("exact attention, threaded: no jobs is a no-op");
    kvq_exact_attention_many(NULL, 0, 128, 128, 1.0f, 4);
    th_end();
    return th_summary();
}
