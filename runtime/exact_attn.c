#include "exact_attn.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

void kvq_exact_attention(const float *q, const float *k, const float *v, int n, int D, long row_stride, float scale,
                         float *out)
{
    /* Two passes (max, then weights) so nothing overflows; no scratch buffer needed. Logits are formed in
     * double: from finite fp32 inputs |q.k| * scale < 1e80, so the max is finite and exp(s - max) never meets
     * inf - inf. A non-finite input gives NaN outputs (never a silent 0): callers check their inputs. */
    double mx = -INFINITY;
    for (int t = 0; t < n; t++) {
        double s = 0;
        for (int c = 0; c < D; c++) s += (double)q[c] * k[t * row_stride + c];
        s *= scale;
        if (s > mx) mx = s;
    }
    double acc[512];
    int chunk = D < 512 ? D : 512;
    for (int c0 = 0; c0 < D; c0 += chunk) {
        int cn = D - c0 < chunk ? D - c0 : chunk;
        double denom = 0;
        for (int c = 0; c < cn; c++) acc[c] = 0;
        for (int t = 0; t < n; t++) {
            double s = 0;
            for (int c = 0; c < D; c++) s += (double)q[c] * k[t * row_stride + c];
            double w = exp(s * scale - mx);
            denom += w;
            for (int c = 0; c < cn; c++) acc[c] += w * v[t * row_stride + c0 + c];
        }
        for (int c = 0; c < cn; c++) out[c0 + c] = n > 0 ? (float)(acc[c] / denom) : 0.0f;
    }
}

/* ---------------------------------------------------------------------------------------- many, threaded -- */

typedef struct {
    const kvq_exact_job *jobs;
    size_t n_jobs;
    int D;
    long row_stride;
    float scale;
    atomic_size_t next; /* the next job nobody has taken: jobs differ in length, so threads take them one by one */
} exact_batch;

static void *exact_worker(void *arg)
{
    exact_batch *b = arg;
    for (;;) {
        size_t i = atomic_fetch_add(&b->next, 1);
        if (i >= b->n_jobs) return NULL;
        const kvq_exact_job *j = &b->jobs[i];
        kvq_exact_attention(j->q, j->k, j->v, j->n, b->D, b->row_stride, b->scale, j->out);
    }
}

void kvq_exact_attention_many(const kvq_exact_job *jobs, size_t n_jobs, int D, long row_stride, float scale,
                              int threads)
{
    exact_batch b = {jobs, n_jobs, D, row_stride, scale, 0};
    if (threads <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        threads = c > 0 ? (int)c : 1;
    }
    if ((size_t)threads > n_jobs) threads = n_jobs ? (int)n_jobs : 1;
    pthread_t tid[64];
    if (threads > 64) threads = 64;
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tid[started], NULL, exact_worker, &b)) break;
        started++;
    }
    exact_worker(&b); /* the caller is a worker too */
    for (int t = 0; t < started; t++) pthread_join(tid[t], NULL);
}
