/* ZipCache saliency in the reference backend (He et al. 2024, Eq. 7-9, Algorithms 2-3 of Appendix B).
 *
 * Prefill (Alg. 2): probe queries of the prompt (kvq_select_probes over positions [0, T): recent + random),
 * their attention rows A_probe = softmax(q K^T * scale) over the keys they can see (causal: keys 0..p; fp16 keys,
 * exact precision, as the prompt's own attention is), the saliency p~ of every token (Eq. 8 normalized or Eq. 7
 * accumulated), and Split: the round(ratio * n) most salient of the tokens being quantized form the high class.
 *
 * Decode (Alg. 3): new tokens wait fp16 in the window and are compressed every W (= `interval`) tokens. The
 * probe rows are those of decode queries: at the start of each cycle (after the prefill and after each
 * compression) the probes are chosen with the same rule among the positions of the decode steps until the next
 * compression (Alg. 3 draws them as it goes: the 5 newest of the 100 plus a 5% random draw; the choice upfront
 * makes it deterministic and seeded); a probe step records its query's attention probabilities over the
 * waiting tokens, taken from the decode attention itself (softmax over the whole cache as attended, as Eq. 4's
 * scores are). Alg. 3 skips the probe row of the 100th query (its compression branch comes first); here the
 * step attends first and compresses after, so the newest query, which sees every waiting token, is always a
 * probe (kvq_select_probes' guarantee). The compressed batch's saliency uses the probe rows restricted to it.
 *
 * GQA: a kv head's tokens are classed once for all its query heads (K and V pages hold each kv head's own
 * class members). Its probe row is the sum over the group's query heads of their probabilities (double, in
 * head order, stored fp32); with Eq. 8 that ranks exactly as stacking every head's row (a constant factor,
 * policy.h) and it is what the paper's code does.
 *
 * Already-quantized tokens are never touched again (the paper's code re-quantizes dequantized data and its error
 * compounds, DESIGN §4). */
#include <math.h>
#include <string.h>

#include "policy.h"
#include "ref.h"

/* Softmax probabilities of one query over n keys (ZipCache Eq. 9's probe rows; double, two passes; e^x by
 * kvq_exp_det, docs/cuda.md "Determinism"), summed into acc. The denominator is the integer sum of
 * kvq_prob_fixed(e) (units of 2^-40), as ref_attend's: an integer sum has one value in any order, so the device's
 * kvq_zip_stats, which sums key chunks in whatever order its blocks run, gets these bits. The maximum is +0, not
 * -0, when it is zero (the device's order key ranks -0 below +0). */
static void softmax_add(const float *q, const float *K, int n, int D, float scale, double *logit, float *acc)
{
    double mx = -INFINITY;
    uint64_t z = 0;
    for (int t = 0; t < n; t++) {
        double s = 0;
        for (int c = 0; c < D; c++) s += (double)q[c] * (double)K[(size_t)t * (size_t)D + (size_t)c];
        logit[t] = s * (double)scale;
        if (logit[t] > mx) mx = logit[t];
    }
    if (mx == 0) mx = 0.0;
    for (int t = 0; t < n; t++) {
        logit[t] = kvq_exp_det(logit[t] - mx);
        z += kvq_prob_fixed(logit[t]);
    }
    double den = (double)z * KVQ_PROB_FIXED_UNIT; /* >= 1: the largest term is e^0 */
    for (int t = 0; t < n; t++) acc[t] = (float)((double)acc[t] + logit[t] / den);
}

/* The most probes kvq_select_probes chooses among n positions (policy.h: ceil(recent * n), at least 1, plus
 * round(random * n), at most n). */
int ref_probe_bound(const kvq_saliency_cfg *s, int n)
{
    int r = kvq_frac_ceil(s->probe_recent, n);
    if (r < 1) r = 1;
    r += kvq_frac_round(s->probe_random, n);
    return r < n ? r : n;
}

size_t ref_saliency_prefill_scratch_bytes(const ref_qlayer *L, int T, int n)
{
    (void)n;
    size_t np = (size_t)ref_probe_bound(&L->cfg->saliency, T);
    /* probe positions, A [n_probes][T], saliency [T], logits [T] (double) */
    return ref_arena_need((size_t)T * sizeof(int)) + ref_arena_need(np * (size_t)T * sizeof(float)) +
           ref_arena_need((size_t)T * sizeof(float)) + ref_arena_need((size_t)T * sizeof(double));
}

void ref_saliency_prefill(const ref_qlayer *L, const float *k, const float *q, int T, int first, int n,
                          unsigned char *is_high, ref_arena *scratch)
{
    const kvq_saliency_cfg *s = &L->cfg->saliency;
    int H = L->H, D = L->D, g = L->Hq / L->H;
    int *pos = ref_arena_take(scratch, (size_t)T * sizeof(int));
    int np = kvq_select_probes(s, 0, T, L->seed, pos);
    float *A = ref_arena_take(scratch, (size_t)np * (size_t)T * sizeof(float));
    float *sal = ref_arena_take(scratch, (size_t)T * sizeof(float));
    double *logit = ref_arena_take(scratch, (size_t)T * sizeof(double));
    int high = kvq_saliency_high_count(s, n);

    for (int h = 0; h < H; h++) {
        const float *kh = k + (size_t)h * (size_t)T * (size_t)D;
        memset(A, 0, (size_t)np * (size_t)T * sizeof *A);
        for (int j = 0; j < g; j++) {
            const float *qh = q + (size_t)(h * g + j) * (size_t)T * (size_t)D;
            for (int r = 0; r < np; r++)
                softmax_add(qh + (size_t)pos[r] * (size_t)D, kh, pos[r] + 1, D, L->scale, logit,
                            A + (size_t)r * (size_t)T); /* Eq. 9, causal */
        }
        kvq_saliency(s->metric, A, pos, np, T, sal); /* Eq. 8 (or Eq. 7) */
        kvq_select_salient(sal + first, n, high, is_high + (size_t)h * (size_t)n);
    }
}

void ref_saliency_new_cycle(ref_qlayer *L)
{
    const ref_win *w = &L->win[0];
    int wcap = L->rule[0].capacity;
    L->cycle_first = w->count ? w->pos[0] : L->length;
    /* The next compression happens when the window holds wcap tokens: after wcap - count more steps. */
    int steps = wcap - w->count;
    L->n_probes = kvq_select_probes(&L->cfg->saliency, L->length, steps, L->seed, L->probe_pos);
    L->n_rows = 0;
}

void ref_saliency_record(ref_qlayer *L, int pos, const float *probs, int length)
{
    if (L->n_rows >= L->n_probes || L->probe_pos[L->n_rows] != pos) return;
    int H = L->H, g = L->Hq / L->H, wcap = L->rule[0].capacity;
    const ref_win *w = &L->win[0];
    for (int h = 0; h < H; h++) {
        float *row = L->rows + ((size_t)L->n_rows * (size_t)H + (size_t)h) * (size_t)wcap;
        for (int sl = 0; sl < w->count; sl++) {
            int p = w->pos[sl];
            double acc = 0;
            for (int j = 0; j < g; j++) acc += probs[(size_t)(h * g + j) * (size_t)length + (size_t)p];
            row[sl] = (float)acc;
        }
        /* Tokens that arrive after this probe: it cannot see them (kvq_saliency ignores them; zeros anyway). */
        for (int sl = w->count; sl < wcap; sl++) row[sl] = 0.0f;
    }
    L->n_rows++;
}

size_t ref_saliency_flush_scratch_bytes(const ref_qlayer *L, int B)
{
    return ref_arena_need((size_t)L->probe_cap * (size_t)B * sizeof(float)) +
           ref_arena_need((size_t)L->probe_cap * sizeof(int)) + ref_arena_need((size_t)B * sizeof(float));
}

void ref_saliency_flush(const ref_qlayer *L, int B, unsigned char *is_high, ref_arena *scratch)
{
    const kvq_saliency_cfg *s = &L->cfg->saliency;
    int H = L->H, wcap = L->rule[0].capacity, nr = L->n_rows;
    float *A = ref_arena_take(scratch, (size_t)L->probe_cap * (size_t)B * sizeof(float));
    int *ppos = ref_arena_take(scratch, (size_t)L->probe_cap * sizeof(int));
    float *sal = ref_arena_take(scratch, (size_t)B * sizeof(float));
    int high = kvq_saliency_high_count(s, B);
    /* Relative positions: the window's slot i holds position cycle_first + i. */
    for (int r = 0; r < nr; r++) ppos[r] = L->probe_pos[r] - L->cycle_first;
    for (int h = 0; h < H; h++) {
        for (int r = 0; r < nr; r++)
            memcpy(A + (size_t)r * (size_t)B, L->rows + ((size_t)r * (size_t)H + (size_t)h) * (size_t)wcap,
                   (size_t)B * sizeof *A);
        kvq_saliency(s->metric, A, ppos, nr, B, sal);
        kvq_select_salient(sal, B, high, is_high + (size_t)h * (size_t)B);
    }
}
