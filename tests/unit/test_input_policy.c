/* Non-finite and out-of-range input (docs/runtime.md), through the public API on every backend that runs here
 * (a table: a backend added to libkvq adds a line):
 *   - issue 12 case 1: a key or value beyond fp16's range (1e5 in fp32 or bf16) is refused with KVQ_ERR_INVALID,
 *     the message naming the tensor, layer, item, token, kv head, channel and value; the batch is unchanged (a
 *     retry with good data equals a clean run);
 *   - case 4: NaN or Inf in K, V or Q, in prefill, decode and calibration: refused the same way;
 *   - case 3: 1-bit with an fp16 scale on groups wider than 65504 (uniform in +-34000): finite outputs, the
 *     reconstruction within the exact step's bound (max - z) / 2, and the backends agree;
 *   - large finite logits (queries of 1e20): finite outputs that agree between backends (no inf - inf). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "harness.h"
#include "kvq.h"
#include "test_engine_util.h"

enum { L = 2, H = 4, HKV = 2, D = 64, N = 40 };

/* Every backend checked against the reference. */
static const struct {
    kvq_backend_kind kind;
} backends[] = {{KVQ_BACKEND_REFERENCE}, {KVQ_BACKEND_EMU}, {KVQ_BACKEND_CPU}};
#define N_BACKENDS ((int)(sizeof backends / sizeof backends[0]))

static const char kivi_text[] = "scheme k { key { bits 2; per channel; group 8; } value { bits 2; per token; group 32; }"
                                " residual 8; }\n";
/* 1-bit, fp16 scale (the default), no fp16 window: every token is quantized. */
static const char one_bit_text[] = "scheme b1 { key { bits 1; per channel; group 8; } value { bits 1; per token; group 32; }"
                                   " residual 8; }\n";
static const char tailor_text[] =
    "scheme t { classify dense_preference { queries 4; top 50%; tau 0.2; }\n"
    "  when quantize { key { bits 2; per channel; group 8; } value { bits 2; per token; group 32; } residual 8; }\n"
    "  when sparse { host_offload; sinks 2; recent 6; topk 8; critical_channels 8; }\n"
    "  layers 0..1 { mode auto; } }\n";

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float uni(void)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 4503599627370496.0 - 1.0);
}

/* An engine on backend b, or NULL with *skip set when the backend cannot run here. */
static kvq_engine *engine_on(const kvq_scheme *sch, kvq_backend_kind b, kvq_dtype dt, int *skip)
{
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){L, H, HKV, D};
    cfg.backend = b;
    cfg.dtype = dt;
    kvq_engine *e = NULL;
    char err[512];
    kvq_status st = kvq_engine_create(sch, &cfg, &e, err, sizeof err);
    *skip = st == KVQ_ERR_UNAVAILABLE || st == KVQ_ERR_UNSUPPORTED;
    if (!*skip) TH_CHECK(st == KVQ_OK, "%s: engine create: %s", kvq_backend_name(b), err);
    return st == KVQ_OK ? e : NULL;
}

static float K[HKV * N * D], V[HKV * N * D], Q[H * N * D];
static void fill(float amp_kv)
{
    for (int i = 0; i < HKV * N * D; i++) K[i] = kvq_f16_round(amp_kv * uni()), V[i] = kvq_f16_round(amp_kv * uni());
    for (int i = 0; i < H * N * D; i++) Q[i] = uni();
}

/* fp32 -> dtype buffer. */
static void *as_dtype(const float *x, size_t n, kvq_dtype dt)
{
    void *b = malloc(n * 4);
    if (!b) return NULL;
    if (dt == KVQ_F32)
        memcpy(b, x, n * 4);
    else if (dt == KVQ_F16)
        kvq_f16_from_f32_n(b, x, n);
    else
        kvq_bf16_from_f32_n(b, x, n);
    return b;
}

static int contains(const char *s, const char *sub) { return strstr(s, sub) != NULL; }

/* Prefill (layer 0) with element `at` of tensor `which` (0 k, 1 v, 2 q) set to bad; checks the refusal, then
 * that the same call with good data succeeds (the failed call stored nothing). */
static void prefill_refused(kvq_engine *e, kvq_dtype dt, int which, size_t at, float bad, const char *expect)
{
    float *src[3] = {K, V, Q};
    size_t cnt[3] = {HKV * N * D, HKV * N * D, H * N * D};
    float keep = src[which][at];
    src[which][at] = bad;
    void *b[3];
    for (int i = 0; i < 3; i++) b[i] = as_dtype(src[i], cnt[i], dt);
    src[which][at] = keep;
    kvq_seq *s = NULL;
    TH_CHECK(kvq_seq_create(e, &s) == KVQ_OK, "seq create");
    kvq_prefill_item it = {s, N, b[0], b[1], b[2]};
    kvq_status st = kvq_prefill(e, 0, &it, 1);
    const char *msg = kvq_engine_errmsg(e);
    TH_CHECK(st == KVQ_ERR_INVALID, "prefill with %s = %g: %s (%s)", which == 0 ? "k" : which == 1 ? "v" : "q",
             (double)bad, kvq_status_str(st), msg);
    TH_CHECK(contains(msg, expect), "message '%s' lacks '%s'", msg, expect);
    TH_CHECK(contains(msg, "layer 0") && contains(msg, "item 0"), "message '%s' does not name layer and item", msg);
    TH_CHECK(kvq_seq_length(s, 0) == 0, "the refused prefill stored %d tokens", kvq_seq_length(s, 0));
    for (int i = 0; i < 3; i++) free(b[i]);
    for (int i = 0; i < 3; i++) b[i] = as_dtype(src[i], cnt[i], dt);
    it = (kvq_prefill_item){s, N, b[0], b[1], b[2]};
    st = kvq_prefill(e, 0, &it, 1);
    TH_CHECK(st == KVQ_OK, "prefill after the refusal: %s", kvq_engine_errmsg(e));
    TH_CHECK(kvq_seq_length(s, 0) == N, "length %d after the good prefill", kvq_seq_length(s, 0));
    for (int i = 0; i < 3; i++) free(b[i]);
    kvq_seq_free(e, s);
}

static void test_prefill_refusals(void)
{
    kvq_spec *sp = tu_spec_text(kivi_text);
    if (!sp) return;
    const kvq_scheme *sch = kvq_spec_scheme(sp, NULL);
    for (int bi = 0; bi < N_BACKENDS; bi++) {
        kvq_backend_kind b = backends[bi].kind;
        kvq_dtype dts[3] = {KVQ_F32, KVQ_F16, KVQ_BF16};
        for (int di = 0; di < 3; di++) {
            th_begin("policy: prefill refuses out-of-range and non-finite K/V/Q, stores nothing (%s, %s)",
                     kvq_backend_name(b), di == 0 ? "fp32" : di == 1 ? "fp16" : "bf16");
            int skip = 0;
            kvq_engine *e = engine_on(sch, b, dts[di], &skip);
            if (skip) {
                printf("SKIP policy prefill %s: the backend cannot run here\n", kvq_backend_name(b));
                continue;
            }
            if (!e) {
                th_end();
                continue;
            }
            fill(1.0f);
            /* k[kv head 1][token 17][channel 5] */
            size_t at = ((size_t)1 * N + 17) * D + 5;
            if (dts[di] != KVQ_F16) { /* fp16 input cannot hold 1e5: it is inf there, covered below */
                /* exact in bf16 too */
                prefill_refused(e, dts[di], 0, at, 98304.0f, "k[kv head 1][token 17][channel 5] = 98304");
                prefill_refused(e, dts[di], 1, at, -70144.0f, "v[kv head 1][token 17][channel 5] = -70144");
            }
            prefill_refused(e, dts[di], 0, at, NAN, "is not finite");
            prefill_refused(e, dts[di], 1, 3, INFINITY, "v[kv head 0][token 0][channel 3] = inf");
            prefill_refused(e, dts[di], 2, ((size_t)3 * N + 39) * D + 63, -INFINITY, "q[head 3][token 39][channel 63]");
            prefill_refused(e, dts[di], 2, 0, NAN, "q[head 0][token 0][channel 0] = nan");
            /* fp16's largest value is fine (bf16's largest below it: 65280) */
            K[at] = dts[di] == KVQ_BF16 ? 65280.0f : 65504.0f;
            float *b3[3];
            for (int i = 0; i < 3; i++) b3[i] = as_dtype(i == 0 ? K : i == 1 ? V : Q, i < 2 ? HKV * N * D : H * N * D, dts[di]);
            kvq_seq *s = NULL;
            kvq_seq_create(e, &s);
            kvq_prefill_item it = {s, N, b3[0], b3[1], b3[2]};
            TH_CHECK(kvq_prefill(e, 0, &it, 1) == KVQ_OK, "65504 refused: %s", kvq_engine_errmsg(e));
            for (int i = 0; i < 3; i++) free(b3[i]);
            kvq_engine_free(e);
            th_end();
        }
    }
    kvq_spec_free(sp);
}

/* A batch of two where only the second item is bad: refused whole, the first sequence unchanged too. */
static void test_batch_all_or_nothing(void)
{
    kvq_spec *sp = tu_spec_text(kivi_text);
    if (!sp) return;
    const kvq_scheme *sch = kvq_spec_scheme(sp, NULL);
    for (int bi = 0; bi < N_BACKENDS; bi++) {
        kvq_backend_kind b = backends[bi].kind;
        int skip = 0;
        kvq_engine *e = engine_on(sch, b, KVQ_F32, &skip);
        if (skip) {
            printf("SKIP policy batch %s: the backend cannot run here\n", kvq_backend_name(b));
            continue;
        }
        th_begin("policy: decode refuses a bad token of item 1 in a batch of 2; nothing stored, retry works (%s)",
                 kvq_backend_name(b));
        if (!e) {
            th_end();
            continue;
        }
        fill(1.0f);
        kvq_seq *s[2] = {NULL, NULL};
        for (int i = 0; i < 2; i++) {
            kvq_seq_create(e, &s[i]);
            kvq_prefill_item it = {s[i], N, K, V, Q};
            TH_CHECK(kvq_prefill(e, 1, &it, 1) == KVQ_OK, "prefill: %s", kvq_engine_errmsg(e));
        }
        float k1[2][HKV * D], v1[2][HKV * D], q1[2][H * D], out[2][H * D];
        for (int i = 0; i < 2; i++) {
            for (int c = 0; c < HKV * D; c++) k1[i][c] = uni(), v1[i][c] = uni();
            for (int c = 0; c < H * D; c++) q1[i][c] = uni();
        }
        kvq_decode_item items[2] = {{s[0], k1[0], v1[0], q1[0], out[0]}, {s[1], k1[1], v1[1], q1[1], out[1]}};
        float keep = v1[1][D + 7];
        v1[1][D + 7] = 1e6f;
        kvq_status st = kvq_decode(e, 1, items, 2);
        const char *msg = kvq_engine_errmsg(e);
        TH_CHECK(st == KVQ_ERR_INVALID, "decode with v = 1e6: %s", kvq_status_str(st));
        TH_CHECK(contains(msg, "item 1") && contains(msg, "layer 1") &&
                     contains(msg, "v[kv head 1][token 40][channel 7] = 1e+06"),
                 "message: %s", msg);
        TH_CHECK(kvq_seq_length(s[0], 1) == N && kvq_seq_length(s[1], 1) == N, "lengths %d %d after the refusal",
                 kvq_seq_length(s[0], 1), kvq_seq_length(s[1], 1));
        v1[1][D + 7] = keep;
        q1[0][5] = NAN;
        st = kvq_decode(e, 1, items, 2);
        TH_CHECK(st == KVQ_ERR_INVALID && contains(kvq_engine_errmsg(e), "q[head 0][token 40][channel 5] = nan"),
                 "decode with a NaN query: %s: %s", kvq_status_str(st), kvq_engine_errmsg(e));
        q1[0][5] = 0.5f;
        st = kvq_decode(e, 1, items, 2);
        TH_CHECK(st == KVQ_OK, "retry: %s", kvq_engine_errmsg(e));
        for (int i = 0; i < 2 * H * D; i++) TH_CHECK(isfinite(out[i / (H * D)][i % (H * D)]), "output %d not finite", i);
        TH_CHECK(kvq_seq_length(s[0], 1) == N + 1 && kvq_seq_length(s[1], 1) == N + 1, "lengths after the retry");
        kvq_engine_free(e);
        th_end();
    }
    kvq_spec_free(sp);
}

static void test_calibration_refusal(void)
{
    kvq_spec *sp = tu_spec_text(tailor_text);
    if (!sp) return;
    const kvq_scheme *sch = kvq_spec_scheme(sp, NULL);
    th_begin("policy: calibration refuses NaN keys and infinite queries (reference)");
    int skip = 0;
    kvq_engine *e = engine_on(sch, KVQ_BACKEND_REFERENCE, KVQ_F32, &skip);
    if (e) {
        fill(1.0f);
        K[100] = NAN;
        double score = 0;
        kvq_status st = kvq_calibrate_layer(e, 0, N, K, Q, &score);
        TH_CHECK(st == KVQ_ERR_INVALID && contains(kvq_engine_errmsg(e), "k[kv head 0][token 1][channel 36] = nan"),
                 "NaN key: %s: %s", kvq_status_str(st), kvq_engine_errmsg(e));
        K[100] = 0;
        Q[7] = INFINITY;
        st = kvq_calibrate_layer(e, 0, N, K, Q, &score);
        TH_CHECK(st == KVQ_ERR_INVALID && contains(kvq_engine_errmsg(e), "= inf"), "inf query: %s: %s",
                 kvq_status_str(st), kvq_engine_errmsg(e));
        TH_CHECK(kvq_engine_layer_state(e, 0) == KVQ_LAYER_UNDECIDED, "a refused calibration decided the layer");
        Q[7] = 0;
        TH_CHECK(kvq_calibrate_layer(e, 0, N, K, Q, &score) == KVQ_OK, "good calibration: %s", kvq_engine_errmsg(e));
        kvq_engine_free(e);
    }
    th_end();
    kvq_spec_free(sp);
}

/* Prefill N tokens and decode `steps` on backend b; outputs [steps][H*D] and the cache of layer 0. */
static kvq_status run(const kvq_scheme *sch, kvq_backend_kind b, int steps, float *outs, float *kc, float *vc,
                      int *skip)
{
    kvq_engine *e = engine_on(sch, b, KVQ_F32, skip);
    if (!e) return KVQ_ERR_UNAVAILABLE;
    kvq_seq *s = NULL;
    kvq_status st = kvq_seq_create(e, &s);
    kvq_prefill_item it = {s, N, K, V, Q};
    if (st == KVQ_OK) st = kvq_prefill(e, 0, &it, 1);
    for (int t = 0; t < steps && st == KVQ_OK; t++) {
        /* the decoded token: the prompt's token t again, with its query */
        float k1[HKV * D], v1[HKV * D], q1[H * D];
        for (int h = 0; h < HKV; h++)
            for (int c = 0; c < D; c++) k1[h * D + c] = K[(h * N + t) * D + c], v1[h * D + c] = V[(h * N + t) * D + c];
        for (int h = 0; h < H; h++)
            for (int c = 0; c < D; c++) q1[h * D + c] = Q[(h * N + t) * D + c];
        kvq_decode_item d = {s, k1, v1, q1, outs + (size_t)t * H * D};
        st = kvq_decode(e, 0, &d, 1);
    }
    int n = 0;
    if (st == KVQ_OK) st = kvq_seq_read_cache(e, s, 0, kc, vc, N + steps, &n);
    if (st != KVQ_OK) TH_CHECK(0, "%s: %s", kvq_backend_name(b), kvq_engine_errmsg(e));
    kvq_engine_free(e);
    return st;
}

enum { STEPS = 12 };
static float ref_out[STEPS * H * D], be_out[STEPS * H * D];
static float ref_k[HKV * (N + STEPS) * D], ref_v[HKV * (N + STEPS) * D], be_k[HKV * (N + STEPS) * D],
    be_v[HKV * (N + STEPS) * D];

static void compare_backends(const kvq_scheme *sch, const char *what)
{
    int skip = 0;
    if (run(sch, KVQ_BACKEND_REFERENCE, STEPS, ref_out, ref_k, ref_v, &skip) != KVQ_OK) return;
    for (int i = 0; i < STEPS * H * D; i++)
        if (!isfinite(ref_out[i])) {
            TH_CHECK(0, "%s: reference output %d is %g", what, i, (double)ref_out[i]);
            break;
        }
    for (int bi = 1; bi < N_BACKENDS; bi++) {
        kvq_backend_kind b = backends[bi].kind;
        if (run(sch, b, STEPS, be_out, be_k, be_v, &skip) != KVQ_OK) {
            if (skip) printf("SKIP %s on %s: the backend cannot run here\n", what, kvq_backend_name(b));
            continue;
        }
        double worst = 0, mag = 0;
        for (int i = 0; i < STEPS * H * D; i++) {
            TH_CHECK(isfinite(be_out[i]), "%s: %s output %d is %g", what, kvq_backend_name(b), i, (double)be_out[i]);
            if (!isfinite(be_out[i])) break;
            double e = fabs((double)be_out[i] - ref_out[i]);
            if (e > worst) worst = e;
            if (fabs(ref_out[i]) > mag) mag = fabs(ref_out[i]);
        }
        TH_CHECK(worst <= 1e-3 * (mag > 1 ? mag : 1), "%s: %s differs from the reference by %g (magnitude %g)", what,
                 kvq_backend_name(b), worst, mag);
        TH_CHECK(!memcmp(be_k, ref_k, sizeof be_k) && !memcmp(be_v, ref_v, sizeof be_v),
                 "%s: %s's cache differs from the reference's", what, kvq_backend_name(b));
    }
}

static void test_one_bit_wide_groups(void)
{
    kvq_spec *sp = tu_spec_text(one_bit_text);
    if (!sp) return;
    const kvq_scheme *sch = kvq_spec_scheme(sp, NULL);
    th_begin("policy: 1-bit fp16-scale groups wider than 65504 (uniform +-34000): finite, within (max - z) / 2, "
             "backends agree (issue 12 case 3)");
    fill(34000.0f);
    int skip = 0;
    if (run(sch, KVQ_BACKEND_REFERENCE, STEPS, ref_out, ref_k, ref_v, &skip) == KVQ_OK) {
        /* Keys: per channel, groups of 8 tokens (prefill quantizes 32 of the 40: the window keeps 8). Each group's
         * exact 1-bit step is max - min (up to rounding of z): the error bound is half of it. */
        int worst_ok = 1, any_wide = 0;
        for (int h = 0; h < HKV; h++)
            for (int c = 0; c < D; c++)
                for (int g = 0; g < 4; g++) {
                    float mn = INFINITY, mx = -INFINITY;
                    for (int t = g * 8; t < g * 8 + 8; t++) {
                        float x = K[(h * N + t) * D + c];
                        mn = x < mn ? x : mn, mx = x > mx ? x : mx;
                    }
                    any_wide |= mx - mn > 65504.0f;
                    for (int t = g * 8; t < g * 8 + 8; t++) {
                        float x = K[(h * N + t) * D + c], y = ref_k[(h * (N + STEPS) + t) * D + c];
                        if (!isfinite(y) || fabs((double)x - y) > (mx - mn) / 2.0 + 32.0) worst_ok = 0;
                    }
                }
        TH_CHECK(any_wide, "no key group wider than 65504: the case does not test saturation");
        TH_CHECK(worst_ok, "a reconstructed key is not finite or beyond (max - min) / 2 of its group");
        for (int i = 0; i < HKV * (N + STEPS) * D; i++)
            if (!isfinite(ref_v[i])) {
                TH_CHECK(0, "value %d reconstructs to %g", i, (double)ref_v[i]);
                break;
            }
    }
    compare_backends(sch, "1-bit wide groups");
    th_end();
    kvq_spec_free(sp);
}

static void test_large_logits(void)
{
    kvq_spec *sp = tu_spec_text(kivi_text);
    if (!sp) return;
    const kvq_scheme *sch = kvq_spec_scheme(sp, NULL);
    th_begin("policy: queries of 1e20 and keys near 65504 (logits ~1e26): finite outputs, backends agree");
    fill(60000.0f);
    for (int i = 0; i < H * N * D; i++) Q[i] = 1e20f * uni();
    compare_backends(sch, "large logits");
    /* a query past the bound is refused */
    int skip = 0;
    kvq_engine *e = engine_on(sch, KVQ_BACKEND_REFERENCE, KVQ_F32, &skip);
    if (e) {
        fill(1.0f);
        Q[(2 * N + 3) * D + 9] = 3e37f;
        kvq_seq *s = NULL;
        kvq_seq_create(e, &s);
        kvq_prefill_item it = {s, N, K, V, Q};
        kvq_status st = kvq_prefill(e, 0, &it, 1);
        TH_CHECK(st == KVQ_ERR_INVALID && contains(kvq_engine_errmsg(e), "q[head 2][token 3][channel 9] = 3e+37"),
                 "query of 3e37: %s: %s", kvq_status_str(st), kvq_engine_errmsg(e));
        kvq_engine_free(e);
    }
    th_end();
    kvq_spec_free(sp);
}

/* fp16 input reaches a backend that takes it (backend.h `prefill_f16`: cuda, emu) as the caller's rows, and through
 * the fp32 path everywhere else and whenever the host changes the rows (calibration: the first prefill of
 * TailorKV's auto layer). Either way an fp16 engine stores what an fp32 engine stores for the same values: read_cache and
 * every decode output equal bit for bit, on every backend, a quantized layer and a sparse (host_offload) one. */
static void test_fp16_rows(void)
{
    /* layer 0 calibrated (fp32 path on every backend), layer 1 sparse from the start */
    static const char tailor_fixed[] =
        "scheme t { classify dense_preference { queries 4; top 50%; tau 0.2; }\n"
        "  when quantize { key { bits 2; per channel; group 8; } value { bits 2; per token; group 32; } residual 8; }\n"
        "  when sparse { host_offload; sinks 2; recent 6; topk 8; critical_channels 8; }\n"
        "  layers 0..0 { mode auto; } layers 1..1 { mode sparse; } }\n";
    static const char *texts[2] = {kivi_text, tailor_fixed};
    enum { S = 2, STEPS = 3 };
    for (int ti = 0; ti < 2; ti++) {
        kvq_spec *sp = tu_spec_text(texts[ti]);
        if (!sp) return;
        const kvq_scheme *sch = kvq_spec_scheme(sp, NULL);
        for (int bi = 0; bi < N_BACKENDS; bi++) {
            kvq_backend_kind b = backends[bi].kind;
            int skip = 0;
            kvq_engine *e32 = engine_on(sch, b, KVQ_F32, &skip), *e16 = skip ? NULL : engine_on(sch, b, KVQ_F16, &skip);
            if (skip) {
                printf("SKIP policy fp16 rows %s: the backend cannot run here\n", kvq_backend_name(b));
                kvq_engine_free(e32);
                continue;
            }
            th_begin("fp16 rows: an fp16 engine's caches and outputs equal an fp32 engine's on the same values (%s, %s)",
                     kvq_backend_name(b), ti ? "TailorKV: a calibrated layer, a sparse one" : "KIVI");
            fill(1.0f);
            for (int i = 0; i < H * N * D; i++) Q[i] = kvq_f16_round(Q[i]);
            kvq_seq *s32[S] = {NULL, NULL}, *s16[S] = {NULL, NULL};
            for (int l = 0; l < L && e32 && e16 && !th_failed(); l++)
                for (int i = 0; i < S && !th_failed(); i++) {
                    int T = N - 7 * i; /* rows [heads][T][D]: the first T tokens of each head's N */
                    float *k = malloc((size_t)HKV * T * D * 4), *v = malloc((size_t)HKV * T * D * 4),
                          *q = malloc((size_t)H * T * D * 4);
                    for (int h = 0; h < HKV; h++) {
                        memcpy(k + (size_t)h * T * D, K + (size_t)h * N * D, (size_t)T * D * 4);
                        memcpy(v + (size_t)h * T * D, V + (size_t)h * N * D, (size_t)T * D * 4);
                    }
                    for (int h = 0; h < H; h++) memcpy(q + (size_t)h * T * D, Q + (size_t)h * N * D, (size_t)T * D * 4);
                    void *k16 = as_dtype(k, (size_t)HKV * T * D, KVQ_F16), *v16 = as_dtype(v, (size_t)HKV * T * D, KVQ_F16),
                         *q16 = as_dtype(q, (size_t)H * T * D, KVQ_F16);
                    if (l == 0) TH_CHECK(kvq_seq_create(e32, &s32[i]) == KVQ_OK && kvq_seq_create(e16, &s16[i]) == KVQ_OK, "seq");
                    kvq_prefill_item a = {s32[i], T, k, v, q}, c = {s16[i], T, k16, v16, q16};
                    TH_CHECK(!th_failed() && kvq_prefill(e32, l, &a, 1) == KVQ_OK, "fp32 prefill: %s", kvq_engine_errmsg(e32));
                    TH_CHECK(!th_failed() && kvq_prefill(e16, l, &c, 1) == KVQ_OK, "fp16 prefill: %s", kvq_engine_errmsg(e16));
                    free(k), free(v), free(q), free(k16), free(v16), free(q16);
                }
            float k1[HKV * D], v1[HKV * D], q1[H * D], o32[H * D], o16[H * D];
            uint16_t k1h[HKV * D], v1h[HKV * D], q1h[H * D];
            for (int st = 0; st < STEPS && !th_failed(); st++)
                for (int l = 0; l < L && !th_failed(); l++)
                    for (int i = 0; i < S && !th_failed(); i++) {
                        for (int c = 0; c < HKV * D; c++) k1[c] = kvq_f16_round(uni()), v1[c] = kvq_f16_round(uni());
                        for (int c = 0; c < H * D; c++) q1[c] = kvq_f16_round(uni());
                        kvq_f16_from_f32_n(k1h, k1, HKV * D), kvq_f16_from_f32_n(v1h, v1, HKV * D);
                        kvq_f16_from_f32_n(q1h, q1, H * D);
                        kvq_decode_item a = {s32[i], k1, v1, q1, o32}, c = {s16[i], k1h, v1h, q1h, o16};
                        TH_CHECK(kvq_decode(e32, l, &a, 1) == KVQ_OK && kvq_decode(e16, l, &c, 1) == KVQ_OK,
                                 "decode: %s / %s", kvq_engine_errmsg(e32), kvq_engine_errmsg(e16));
                        TH_CHECK(th_failed() || !memcmp(o32, o16, sizeof o32),
                                 "step %d, layer %d, sequence %d: outputs differ (max %.3g)", st, l, i,
                                 tu_max_abs_diff(o32, o16, H * D));
                    }
            for (int l = 0; l < L && !th_failed(); l++)
                for (int i = 0; i < S && !th_failed(); i++) {
                    enum { CAP = N + STEPS };
                    static float a[2][HKV * CAP * D], c[2][HKV * CAP * D];
                    int na = 0, nc = 0;
                    memset(a, 0, sizeof a), memset(c, 0, sizeof c);
                    TH_CHECK(kvq_seq_read_cache(e32, s32[i], l, a[0], a[1], CAP, &na) == KVQ_OK &&
                                 kvq_seq_read_cache(e16, s16[i], l, c[0], c[1], CAP, &nc) == KVQ_OK && na == nc,
                             "read_cache: %d and %d tokens", na, nc);
                    TH_CHECK(th_failed() || !memcmp(a, c, sizeof a), "layer %d, sequence %d: caches differ", l, i);
                }
            kvq_engine_free(e32);
            kvq_engine_free(e16);
            th_end();
        }
        kvq_spec_free(sp);
    }
}

int main(void)
{
    test_prefill_refusals();
    test_batch_all_or_nothing();
    test_calibration_refusal();
    test_one_bit_wide_groups();
    test_large_logits();
    test_fp16_rows();
    return th_summary();
}
