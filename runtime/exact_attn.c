#include "exact_attn.h"

#include <math.h>

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
