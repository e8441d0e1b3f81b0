/* Policy mathematics shared by every backend, as pure functions over fp32 arrays: the formulas of the papers,
 * each citing its source. Backends decide *when* to call them (streaming rules); these decide *what*.
 *
 * Conventions of the whole file (docs/policies.md gives the reasons):
 * - Nothing allocates, prints or aborts; accumulation is in double where sums are long.
 * - Every ranking compares fp32 values through kvq_float_key: -0 ranks equal to +0, NaN ranks below -inf.
 * - Ties go to the lower index (the earlier token, the lower channel). Results never depend on the platform's
 *   qsort or on rand(): the one PRNG is splitmix64, seeded by the caller.
 * - A fraction f of n items rounds with a 1e-9 tolerance, so 0.07 * 100 is 7 (not 8, as ceil of the double
 *   product 7.000000000000001 would give). */
#ifndef KVQ_POLICY_H
#define KVQ_POLICY_H

#include <stdint.h>

#include "scheme.h"

/* ---------------------------------------------------------------- ZipCache (policy_saliency.c) ---------- */

/* ZipCache Eq. 9 / Table 2 probe strategy "random + recent": probe queries of a batch of n tokens at positions
 * [first, first + n): the ceil(recent * n) newest (at least 1, so the newest token, which sees every token, is
 * always a probe), plus round(random * n) (halves up) drawn uniformly without replacement from the other
 * n - n_recent positions. Draws depend only on (seed, first). Writes ascending positions to pos (capacity n),
 * returns their count (at least 1 when n > 0, 0 when n <= 0). */
int kvq_select_probes(const kvq_saliency_cfg *s, int first, int n, uint64_t seed, int *pos);

/* ZipCache Eq. 7-8. A: [n_probes][n_tokens] attention probabilities of the probes over tokens [0, n_tokens)
 * (causal: a probe at position p has zeros beyond p; entries beyond p are ignored whatever they hold).
 *   accumulated (Eq. 7, H2O / MiKV): p_i = sum_k A[k,i]
 *   normalized  (Eq. 8):             p_i = sum_k A[k,i] / nnz(A[:,i]),
 * nnz counting the probes that can see token i (probe_pos[k] >= i), not all probes (the paper's code divides by
 * n_tokens - i, a count that assumes every query is a probe). A token no probe can see (i > every probe_pos)
 * gets saliency 0 under both metrics (an empty sum; there is no evidence it is salient). probe_pos NULL means
 * every probe sees every token. KVQ_SAL_NONE writes 0 everywhere.
 * GQA: stack the probe rows of every query head of the kv head's group into A (probe_pos repeated per head);
 * the normalized result is then the mean over heads and probes, which ranks exactly as the paper's code does
 * (it sums the group's heads, a constant factor). */
void kvq_saliency(kvq_saliency_metric metric, const float *A, const int *probe_pos, int n_probes, int n_tokens,
                  float *out);

/* Marks the n_high tokens of largest saliency (ties: the earlier token wins). n_high is clamped to [0, n]. */
void kvq_select_salient(const float *saliency, int n, int n_high, unsigned char *is_high);

/* splitmix64 (Steele, Lea, Flood 2014): advances *state and returns the next 64-bit output. The project's one
 * PRNG (seed 0 gives 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, ...). */
uint64_t kvq_splitmix64(uint64_t *state);

/* ---------------------------------------------------------------- TailorKV (policy_tailorkv.c) ---------- */

/* TailorKV Eq. 6-8 for one head: A = softmax(Q_last K^T * scale) over n keys for the last n_q queries, causal
 * within the prompt (the query at position p sees keys 0..p; the authors' code applies no mask), then
 * P = n_q - sum of each row's top-k probabilities, k = ceil(top * n) (the same k for every row, as Eq. 7 has
 * it; a row that sees fewer than k keys keeps all its mass). n_q is clamped to n. q: [n][D] (the function takes
 * the last n_q rows), k: [n][D]. Returns a value in [0, n_q]; each row's share is computed as the mass outside
 * the top-k (not 1 - mass inside), so it is exact near 0. */
double kvq_dense_preference_head(const float *q, const float *k, int n, int D, int n_q, double top, float scale);

/* TailorKV Eq. 9's P_l for one layer: the mean over query heads and query rows of the per-row sparse error,
 *   P_l = sum_h P_h / (heads * n_q),   P_h = kvq_dense_preference_head of query head h against kv head
 *   h / (heads / kv_heads)   (GQA: consecutive query heads share a kv head),
 * the normalisation the authors' identification code uses (it divides by last_q * num_heads) and the one
 * tau = 0.2 is calibrated against. A layer is quantization-friendly iff P_l > tau. q: [heads][n][D],
 * k: [kv_heads][n][D]. scratch: NULL, or n floats that make it ~5x faster (logits kept instead of recomputed;
 * results are bit-identical either way). Returns NaN for invalid shapes (n, D, heads, kv_heads < 1, or heads
 * not a multiple of kv_heads), 0 when n_q < 1. */
double kvq_dense_preference_layer(const float *q, const float *k, int heads, int kv_heads, int n, int D, int n_q,
                                  double top, float scale, float *scratch);

/* e^x from IEEE-754 double additions, subtractions and multiplications only (Cody-Waite reduction by ln 2, the
 * Taylor polynomial of degree 13 by Horner, an exact scaling by 2^k): within 2 ulp of exp, no library call and
 * no fused operation, so a GPU kernel reproduces it bit for bit (the dense preference score uses it; the CUDA
 * backend's kvq_tk_dense computes the same). NaN for NaN, +inf above 709.78, 0 below -745.13. */
double kvq_exp_det(double x);

/* ZipCache's probe-row normaliser (docs/cuda.md "Determinism"): each weight e in [0, 1] as an integer of 2^-40
 * units, truncated, so that the normaliser Z = KVQ_PROB_FIXED_UNIT * sum is an integer sum whose value does not
 * depend on the order of its terms: ref_attend and the device's kvq_zip_norm, summing in different orders, get the
 * same bits. The truncation moves Z by less than n * 2^-40 (Z >= 1: the largest term is e^0). Device copy in
 * templates/kvq_policy.cuh. */
#define KVQ_PROB_FIXED_UNIT 9.094947017729282e-13 /* 2^-40 */
static inline uint64_t kvq_prob_fixed(double e) { return (uint64_t)(e * 1099511627776.0); }

/* TailorKV App. I reduce_q: the query the kv head `kv_head` uses for Eq. 10 and token scoring, the mean of its
 * group's query heads (heads / kv_heads consecutive heads; a plain copy for MHA). The mean is of signed values:
 * Eq. 10 takes |.| after the reduction. q: [heads][D], out: [D]. */
void kvq_reduce_q_group(const float *q, int heads, int kv_heads, int D, int kv_head, float *out);

/* TailorKV Eq. 10's max_t |K_t,i| per channel over n keys (App. I: absmax_k, taken over the prompt at
 * prefill). k: [n][D], out: [D]; 0 when n = 0. */
void kvq_key_absmax(const float *k, int n, int D, float *out);

/* TailorKV Eq. 10: channel scores |q_i| * max_t |K_t,i| (fp32 product); writes the n_sel best channel indices
 * in descending score order (ties: lower index) to idx; n_sel is clamped to [0, D]. */
void kvq_critical_channels(const float *q, const float *k_absmax, int D, int n_sel, int *idx);

/* TailorKV Sec. 4.2 / App. I approximate_attn: each key's score on the critical channels only,
 * out[t] = sum_c q[ch[c]] * k[t][ch[c]] (signed q, no softmax scale: only the ranking is used). k: [n][D]. */
void kvq_critical_scores(const float *q, const float *k, int n, int D, const int *ch, int n_ch, float *out);

/* ---------------------------------------------------------------- selection (policy_select.c) ---------- */

/* Indices of the k largest scores (ties: lower index), in descending score order. Writes min(k, n) entries
 * (none for k <= 0). */
void kvq_topk(const float *scores, int n, int k, int *idx);

/* Indices of the k smallest scores (ties: lower index), in ascending score order (OTT's pool of the N smallest
 * key L1 norms). NaN ranks last here too. Writes min(k, n) entries. */
void kvq_bottomk(const float *scores, int n, int k, int *idx);

/* OTT Sec. 3.2 / App. E: the outlier metric of one key, S_i = ||K_i||_1 (accumulated in double). */
float kvq_key_l1(const float *k, int D);

/* Fractions of a count n, clamped to [0, n], with the file's 1e-9 tolerance: ceil(f * n) and round(f * n)
 * (halves up). */
int kvq_frac_ceil(double f, int n);
int kvq_frac_round(double f, int n);

/* Selection primitives the functions above share. */

/* Order-preserving 32-bit key of a float: a < b  =>  key(a) < key(b); key(-0) == key(+0); NaN -> 0, below the
 * key of -inf. */
uint32_t kvq_float_key(float f);

/* Items are ranked by key(ctx, i), larger first, ties to the lower index. */
typedef uint32_t (*kvq_key_fn)(const void *ctx, int i);

/* Radix selection (4 passes of key calls over n items): the key T of the k-th ranked item (1 <= k <= n). The k
 * best items are every item with key > T plus the first *ties items (by index) with key == T. */
uint32_t kvq_kth_largest_key(kvq_key_fn key, const void *ctx, int n, int k, int *ties);

/* The k best items by key, in rank order (descending key, ties lower index); writes min(k, n) entries. */
void kvq_topk_keyed(kvq_key_fn key, const void *ctx, int n, int k, int *idx);

#endif
