/* A backend against the reference on a rotated scheme (test_rotate.c: cpu; test_cuda_rotate.c: emu): a batch of
 * sequences of different lengths prefilled and decoded on structured K/V (outlier channels), every decode
 * output within 1e-3 of the reference's (relative to the head's magnitude), read_cache bit-identical. Header-only:
 * each test program includes it once. */
#ifndef KVQ_TEST_ROTATE_UTIL_H
#define KVQ_TEST_ROTATE_UTIL_H

#include "test_engine_util.h"

static kvq_engine *tr_engine(const kvq_scheme *s, kvq_backend_kind kind, int layers, int heads, int kv_heads, int D,
                             char *err, size_t n)
{
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){layers, heads, kv_heads, D};
    cfg.dtype = KVQ_F32;
    cfg.backend = kind;
    cfg.threads = 2;
    kvq_engine *e = NULL;
    return kvq_engine_create(s, &cfg, &e, err, n) == KVQ_OK ? e : NULL;
}

/* Rows [t0, t0 + n) of heads of a synth tensor of one layer ([heads][T][D]) as [heads][n][D]. */
static float *tr_rows(const float *X, int heads, size_t T, int D, size_t t0, int n)
{
    float *o = malloc((size_t)heads * n * D * sizeof *o);
    for (int h = 0; h < heads; h++) memcpy(o + (size_t)h * n * D, X + ((size_t)h * T + t0) * D, (size_t)n * D * 4);
    return o;
}

#define TR_BATCH 2
static void tr_compare(const char *spec_text, const char *name, kvq_backend_kind kind, int heads, int kv_heads, int D)
{
    static const int prompt[TR_BATCH] = {37, 161}, steps = 5;
    const int L = 2;
    kvq_spec *spec = tu_spec_text(spec_text);
    const kvq_scheme *s = spec ? kvq_spec_scheme(spec, name) : NULL;
    char err[512] = "";
    kvq_engine *ref = s ? tr_engine(s, KVQ_BACKEND_REFERENCE, L, heads, kv_heads, D, err, sizeof err) : NULL;
    kvq_engine *be = ref ? tr_engine(s, kind, L, heads, kv_heads, D, err, sizeof err) : NULL;
    TH_CHECK(ref && be, "engines: %s", err);
    kvq_synth_params sp = kvq_synth_params_default();
    sp.layers = L, sp.kv_heads = kv_heads, sp.heads = heads, sp.head_dim = D, sp.tokens = 170, sp.seed = 5;
    kvq_synth syn = {0};
    TH_CHECK(kvq_synth_generate(&sp, &syn, err, sizeof err) == KVQ_OK, "synth: %s", err);
    kvq_seq *rs[TR_BATCH] = {0}, *bs[TR_BATCH] = {0};
    for (int b = 0; b < TR_BATCH && be; b++)
        TH_CHECK(kvq_seq_create(ref, &rs[b]) == KVQ_OK && kvq_seq_create(be, &bs[b]) == KVQ_OK, "seq create");
    size_t T = (size_t)sp.tokens;
    for (int l = 0; l < L && be && !th_failed(); l++) {
        const float *K = syn.k + (size_t)l * kv_heads * T * D, *V = syn.v + (size_t)l * kv_heads * T * D;
        const float *Q = syn.q + (size_t)l * heads * T * D;
        kvq_prefill_item ri[TR_BATCH], bi[TR_BATCH];
        float *x[TR_BATCH][3];
        for (int b = 0; b < TR_BATCH; b++) {
            x[b][0] = tr_rows(K, kv_heads, T, D, 0, prompt[b]);
            x[b][1] = tr_rows(V, kv_heads, T, D, 0, prompt[b]);
            x[b][2] = tr_rows(Q, heads, T, D, 0, prompt[b]);
            ri[b] = (kvq_prefill_item){rs[b], prompt[b], x[b][0], x[b][1], x[b][2]};
            bi[b] = (kvq_prefill_item){bs[b], prompt[b], x[b][0], x[b][1], x[b][2]};
        }
        TH_CHECK(kvq_prefill(ref, l, ri, TR_BATCH) == KVQ_OK, "ref prefill: %s", kvq_engine_errmsg(ref));
        TH_CHECK(kvq_prefill(be, l, bi, TR_BATCH) == KVQ_OK, "%s prefill: %s", kvq_backend_name(kind),
                 kvq_engine_errmsg(be));
        for (int b = 0; b < TR_BATCH; b++)
            for (int i = 0; i < 3; i++) free(x[b][i]);
        for (int st = 0; st < steps && !th_failed(); st++) {
            kvq_decode_item rd[TR_BATCH], bd[TR_BATCH];
            float *m[TR_BATCH][5];
            for (int b = 0; b < TR_BATCH; b++) {
                size_t t = (size_t)prompt[b] + (size_t)st;
                m[b][0] = tr_rows(K, kv_heads, T, D, t, 1);
                m[b][1] = tr_rows(V, kv_heads, T, D, t, 1);
                m[b][2] = tr_rows(Q, heads, T, D, t, 1);
                m[b][3] = calloc((size_t)heads * D, 4);
                m[b][4] = calloc((size_t)heads * D, 4);
                rd[b] = (kvq_decode_item){rs[b], m[b][0], m[b][1], m[b][2], m[b][3]};
                bd[b] = (kvq_decode_item){bs[b], m[b][0], m[b][1], m[b][2], m[b][4]};
            }
            TH_CHECK(kvq_decode(ref, l, rd, TR_BATCH) == KVQ_OK, "ref decode: %s", kvq_engine_errmsg(ref));
            TH_CHECK(kvq_decode(be, l, bd, TR_BATCH) == KVQ_OK, "%s decode: %s", kvq_backend_name(kind),
                     kvq_engine_errmsg(be));
            for (int b = 0; b < TR_BATCH && !th_failed(); b++)
                for (int h = 0; h < heads; h++) {
                    double rel = tu_rel_err(m[b][4] + (size_t)h * D, m[b][3] + (size_t)h * D, (size_t)D, 1e-3);
                    TH_CHECK(rel <= 1e-3, "%s %s D %d layer %d step %d seq %d head %d: error %.3g of the magnitude",
                             name, kvq_backend_name(kind), D, l, st, b, h, rel);
                }
            for (int b = 0; b < TR_BATCH; b++)
                for (int i = 0; i < 5; i++) free(m[b][i]);
        }
        for (int b = 0; b < TR_BATCH && !th_failed(); b++) {
            int cap = prompt[b] + steps, n1 = 0, n2 = 0;
            size_t cnt = (size_t)kv_heads * cap * D;
            float *k1 = malloc(cnt * 4), *v1 = malloc(cnt * 4), *k2 = malloc(cnt * 4), *v2 = malloc(cnt * 4);
            TH_CHECK(kvq_seq_read_cache(ref, rs[b], l, k1, v1, cap, &n1) == KVQ_OK &&
                         kvq_seq_read_cache(be, bs[b], l, k2, v2, cap, &n2) == KVQ_OK && n1 == cap && n2 == cap,
                     "read_cache");
            TH_CHECK(!memcmp(k1, k2, cnt * 4) && !memcmp(v1, v2, cnt * 4), "layer %d seq %d: read_cache differs", l,
                     b);
            free(k1), free(v1), free(k2), free(v2);
        }
    }
    kvq_engine_free(be);
    kvq_engine_free(ref);
    kvq_synth_free(&syn);
    kvq_spec_free(spec);
}

/* The rotated schemes the backends are checked on: per-channel KIVI keys and per-token values, each rotation,
 * an OTT pool (its key metric sees the stored, rotated keys) and ZipCache (its probes see rotated queries). */
static const char tr_specs[] =
    "scheme kivi2_had { key { bits 2; per channel; group 32; rotate hadamard; }\n"
    "                   value { bits 2; per token; group 32; rotate hadamard seed 3; } residual 32; }\n"
    "scheme kivi4_rand { key { bits 4; per channel; group 32; } value { bits 4; per token; group 32; }\n"
    "                    rotate random seed 7; residual 64; }\n"
    "scheme ott_had { key { bits 2; per channel; group 16; } value { bits 2; per token; group 32; } residual 8;\n"
    "                 flush group; outliers { keep 3; by key_l1 smallest; spill 8; } rotate hadamard seed 1; }\n"
    "scheme zip_rand { key { per channel; group all; } value { per token; channel_separable; group hidden; }\n"
    "                  residual 2; saliency normalized { probes recent 20% random 20%; salient 60% bits 4;\n"
    "                  rest bits 2; every 6; } rotate random seed 2; }\n";

#endif
