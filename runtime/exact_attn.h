/* Exact attention, the yardstick every scheme is measured against (kvq eval, tests): double accumulation over
 * fp32 inputs, no quantization. Kept apart from the backends on purpose: it is the definition, not a fast path. */
#ifndef KVQ_EXACT_ATTN_H
#define KVQ_EXACT_ATTN_H

#include <stddef.h>

/* out[D] = softmax(q . K^T * scale) V over n tokens. k, v: n rows of D floats, row_stride floats apart. */
void kvq_exact_attention(const float *q, const float *k, const float *v, int n, int D, long row_stride, float scale,
                         float *out);

/* One attention of a batch for kvq_exact_attention_many. */
typedef struct {
    const float *q, *k, *v;
    int n;
    float *out;
} kvq_exact_job;

/* Every job through kvq_exact_attention (same D, row_stride and scale), spread over `threads` threads (0: the
 * online cores). Each output is computed by one call of that function, so the results are bit-identical to
 * running the jobs one after another, whatever the thread count. Threads that cannot be started leave their
 * share to the others (at worst the caller does everything): it cannot fail. */
void kvq_exact_attention_many(const kvq_exact_job *jobs, size_t n_jobs, int D, long row_stride, float scale,
                              int threads);

#endif
