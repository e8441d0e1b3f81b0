/* The reference backend on every spec of specs/formats/: a prefill and decode steps, then the cache read back
 * (kvq_seq_read_cache) equals, element for element, the format's own quantization of the same values done here
 * group by group with quant.h (tensor scale: the prompt's absolute maximum over every kv head, or the spec's),
 * so the layout, packing (5-bit planes, one-byte e4m3/e8m0 scales, absent zeros) and decode x = z + s * T * L[code]
 * of the pages are exact. The attention output is checked against exact attention over that dequantized cache.
 * The cpu and emulated CUDA backends run every format against this backend: test_cpu_backend's test_formats and
 * test_cuda_formats. */
#include "quant.h"
#include "scheme.h"
#include "test_engine_util.h"

#define H 2
#define HQ 4
#define D 128
#define T0 70 /* prefill */
#define T1 30 /* decode steps */

/* T of head h: x [H][n] the prompt's values of the tensor. */
static float tensor_scale_of(const kvq_tensor_cfg *t, const float *x, size_t n, int h)
{
    if (!kvq_format_has_tensor_scale(t->format.kind)) return 1.0f;
    if (t->format.tensor_scale > 0) return t->format.tensor_scale;
    float amax = 0;
    for (int j = 0; j < H; j++)
        for (size_t i = 0; i < n; i++)
            if (!t->format.tensor_scale_per_head || j == h) amax = fmaxf(amax, fabsf(x[(size_t)j * n + i]));
    return kvq_format_tensor_scale(t->format.kind, amax);
}

/* The value token (h, t) of tensor x [H][T0 + T1][D] must read back as. */
static void expect_token(const kvq_tensor_cfg *t, const float *x, float T, float *out)
{
    const kvq_format_cfg *f = &t->format;
    int bits = kvq_format_code_bits(f, t->bits), G = t->group > 0 ? t->group : D;
    float lv[256];
    uint8_t codes[D];
    kvq_format_levels(f, bits, lv);
    for (int g = 0; g < D / G; g++) {
        kvq_qparams p = kvq_format_quantize_group(f, bits, t->scale_dtype, t->zero_dtype, T, x + g * G, (size_t)G, 1,
                                                  codes + g * G);
        for (int c = g * G; c < (g + 1) * G; c++)
            out[c] = f->kind == KVQ_FMT_INT ? kvq_dequant(codes[c], p) : kvq_format_dequant(lv[codes[c]], p, T);
    }
}

static void run_scheme(const char *file, const kvq_scheme *sch)
{
    const int N = T0 + T1;
    float *k = malloc(sizeof(float) * H * N * D), *v = malloc(sizeof(float) * H * N * D);
    float *q = malloc(sizeof(float) * HQ * D), *out = malloc(sizeof(float) * HQ * D);
    float *rk = malloc(sizeof(float) * H * N * D), *rv = malloc(sizeof(float) * H * N * D);
    float *kp = malloc(sizeof(float) * H * T0 * D), *vp = malloc(sizeof(float) * H * T0 * D);
    float *step_k = malloc(sizeof(float) * H * D), *step_v = malloc(sizeof(float) * H * D);
    float want[D];
    th_begin("ref formats: %s scheme %s: cache read back = the format's quantization", file, sch->name);
    tu_fill(k, (size_t)H * N * D, 3.0f);
    tu_fill(v, (size_t)H * N * D, 1.0f);
    /* Head 1 smaller than head 0 (by a factor that is not a power of two, which fp8 would only shift), so a
     * scale per kv head gives other codes than one per tensor. */
    for (size_t i = (size_t)N * D; i < (size_t)H * N * D; i++) k[i] = kvq_f16_round(k[i] * 0.3f);
    /* An outlier channel, as keys have. */
    for (int h = 0; h < H; h++)
        for (int t = 0; t < N; t++) {
            float *e = &k[((size_t)h * N + (size_t)t) * D + 5];
            *e = kvq_f16_round(*e * 20.0f); /* the engine stores fp16: the expectation starts from the same */
        }
    kvq_engine *e = tu_engine(sch, 1, HQ, H, D, KVQ_F32);
    kvq_seq *s = NULL;
    if (e && kvq_seq_create(e, &s) == KVQ_OK) {
        for (int h = 0; h < H; h++) {
            memcpy(kp + (size_t)h * T0 * D, k + (size_t)h * N * D, sizeof(float) * T0 * D);
            memcpy(vp + (size_t)h * T0 * D, v + (size_t)h * N * D, sizeof(float) * T0 * D);
        }
        kvq_prefill_item it = {s, T0, kp, vp, NULL};
        kvq_status st = kvq_prefill(e, 0, &it, 1);
        TH_CHECK(st == KVQ_OK, "prefill: %s: %s", kvq_status_str(st), kvq_engine_errmsg(e));
        for (int t = T0; t < N && st == KVQ_OK; t++) {
            for (int h = 0; h < H; h++) {
                memcpy(step_k + (size_t)h * D, k + ((size_t)h * N + (size_t)t) * D, sizeof(float) * D);
                memcpy(step_v + (size_t)h * D, v + ((size_t)h * N + (size_t)t) * D, sizeof(float) * D);
            }
            tu_fill(q, (size_t)HQ * D, 1.0f);
            kvq_decode_item d = {s, step_k, step_v, q, out};
            st = kvq_decode(e, 0, &d, 1);
            TH_CHECK(st == KVQ_OK, "decode %d: %s", t, kvq_engine_errmsg(e));
        }
        int n = 0;
        st = kvq_seq_read_cache(e, s, 0, rk, rv, N, &n);
        TH_CHECK(st == KVQ_OK && n == N, "read_cache: %s, %d tokens", kvq_status_str(st), n);
        const kvq_layer_cfg *lc = kvq_scheme_layer(sch, 0);
        int bad = 0;
        for (int which = 0; which < 2 && st == KVQ_OK; which++) {
            const kvq_tensor_cfg *tc = which ? &lc->quant.value : &lc->quant.key;
            const float *x = which ? v : k, *r = which ? rv : rk;
            for (int h = 0; h < H; h++)
                for (int t = 0; t < N; t++) {
                    const float *xt = x + ((size_t)h * N + (size_t)t) * D, *rt = r + ((size_t)h * N + (size_t)t) * D;
                    expect_token(tc, xt, tensor_scale_of(tc, which ? vp : kp, (size_t)T0 * D, h), want);
                    for (int c = 0; c < D; c++)
                        if (memcmp(&want[c], &rt[c], sizeof(float)) != 0 && bad++ < 3)
                            TH_CHECK(0, "%s token %d head %d channel %d: read %.9g, want %.9g (input %.9g)",
                                     which ? "value" : "key", t, h, c, rt[c], want[c], xt[c]);
                }
        }
        TH_CHECK(bad == 0, "%d elements differ", bad);
        /* The last step's output is attention over the cache as read back. */
        if (st == KVQ_OK) {
            float ref[D], Kh[N * D], Vh[N * D];
            double worst = 0;
            for (int hq = 0; hq < HQ; hq++) {
                int h = hq / (HQ / H);
                memcpy(Kh, rk + (size_t)h * N * D, sizeof Kh);
                memcpy(Vh, rv + (size_t)h * N * D, sizeof Vh);
                tu_exact_attention(q + (size_t)hq * D, Kh, Vh, N, D, 1.0 / sqrt((double)D), ref);
                double err = tu_max_abs_diff(out + (size_t)hq * D, ref, D);
                if (err > worst) worst = err;
            }
            TH_CHECK(worst < 1e-4, "attention over the read-back cache: max |diff| %g", worst);
        }
        kvq_seq_free(e, s);
    }
    kvq_engine_free(e);
    th_end();

    /* The cpu backend decodes every format (test_cpu_backend's test_formats), and so does the cuda/emu backend,
     * tensor scales from the prompt included (tests/unit/test_cuda_formats.c). */
    free(k), free(v), free(q), free(out), free(rk), free(rv), free(kp), free(vp), free(step_k), free(step_v);
}

int main(void)
{
    char *names[64];
    int n = th_list_files("specs/formats", ".kvq", names, 64), schemes = 0;
    for (int i = 0; i < n; i++) {
        char rel[256];
        snprintf(rel, sizeof rel, "specs/formats/%s", names[i]);
        kvq_spec *sp = tu_spec_file(rel);
        for (int j = 0; sp && j < kvq_spec_scheme_count(sp); j++, schemes++) run_scheme(rel, kvq_spec_scheme_at(sp, j));
        kvq_spec_free(sp);
        free(names[i]);
    }
    th_begin("ref formats: specs/formats covered");
    TH_CHECK(schemes >= 11, "only %d schemes under specs/formats", schemes);
    th_end();
    return th_summary();
}
