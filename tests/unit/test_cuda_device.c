/* The device-tensor entry points (kvq.h "Device tensors") under the emulator: for every spec in specs/, batches of
 * 1, 3 and 17 sequences of different prompt lengths (varlen prefill with cu_seqlens), an engine fed through
 * kvq_prefill_device / kvq_decode_device with strided device views (q, k, v of one fused [tokens][heads + 2
 * kv_heads][D] buffer; outputs with padded rows, in fp32, bf16 or fp16) must hold the same caches (read_cache,
 * bit for bit) and give the same outputs (bit for bit after the output's rounding) as an engine fed the same
 * values through the host-pointer API; its lse must be the natural log-sum-exp of the scaled scores over the
 * cache read back. "Device" memory is the emulated device's, allocated through the engine's device layer
 * (cu_dev_alloc); the emulator's device addresses are host addresses, so the test fills and reads them directly.
 * Also: the checks of the entry points, and a decode step on a caller's stream in capture mode. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "cuda/cu_backend.h"
#include "cuda/cu_counters.h"
#include "cuda/cu_dev.h"
#include "half.h"
#include "harness.h"
#include "kvq.h"
#include "rt_internal.h"
#include "synth.h"

#define LAYERS 3
#define H 2
#define HQ 4
#define D 128
#define TOK 200
#define STEPS 3
#define ROW (HQ + 2 * H) /* heads of a fused qkv row */
#define OPAD 8           /* padding of an output row */

/* ---- "device" memory of the engine's emulated device ---- */

static void *dev_alloc(kvq_engine *e, size_t bytes)
{
    cu_ctx_scope s;
    uint64_t a = 0;
    char msg[256];
    cu_dev_enter(e->ctx->dev, &s);
    kvq_status st = cu_dev_alloc(e->ctx->dev, bytes, &a, msg, sizeof msg);
    cu_dev_leave(e->ctx->dev, &s);
    return st == KVQ_OK ? (void *)(uintptr_t)a : NULL;
}

static void dev_free(kvq_engine *e, void *p)
{
    cu_ctx_scope s;
    cu_dev_enter(e->ctx->dev, &s);
    cu_dev_free(e->ctx->dev, (uint64_t)(uintptr_t)p);
    cu_dev_leave(e->ctx->dev, &s);
}

static uint16_t to16(kvq_dtype dt, float x) { return dt == KVQ_BF16 ? kvq_bf16_from_f32(x) : kvq_f16_from_f32(x); }

static kvq_engine *engine_for(const kvq_scheme *s, kvq_dtype dt, char *err, size_t n)
{
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){LAYERS, HQ, H, D};
    cfg.dtype = dt;
    cfg.backend = KVQ_BACKEND_EMU;
    kvq_engine *e = NULL;
    return kvq_engine_create(s, &cfg, &e, err, n) == KVQ_OK ? e : NULL;
}

/* token t of layer l: x [heads][D] of tensor w (0 k, 1 v, 2 q) */
static const float *syn_row(const kvq_synth *syn, int w, int l, int h, int t)
{
    int heads = w == 2 ? HQ : H;
    const float *base = w == 0 ? syn->k : w == 1 ? syn->v : syn->q;
    return base + (((size_t)l * heads + h) * TOK + (size_t)t) * D;
}

/* The fused row of token t (sequence offset `shift` into the synthetic tokens, so sequences differ). */
static void fill_fused(uint16_t *row, const kvq_synth *syn, kvq_dtype dt, int l, int t)
{
    for (int h = 0; h < HQ; h++)
        for (int d = 0; d < D; d++) row[h * D + d] = to16(dt, syn_row(syn, 2, l, h, t)[d]);
    for (int w = 0; w < 2; w++)
        for (int h = 0; h < H; h++)
            for (int d = 0; d < D; d++) row[(HQ + w * H + h) * D + d] = to16(dt, syn_row(syn, w, l, h, t)[d]);
}

static kvq_dev_tensor view(void *base, kvq_dtype dt, int head0, long long ts, long long hs)
{
    kvq_dev_tensor t = {(uint16_t *)base + (size_t)head0 * D, dt, ts, hs};
    return t;
}

typedef struct {
    int B;
    kvq_dtype in, out;
} dcase;

static void run_case(const char *file, const kvq_scheme *s, const kvq_synth *syn, const dcase *c)
{
    const char *tn[] = {"fp32", "fp16", "bf16"};
    th_begin("device tensors: %s (%s), batch %d, %s inputs, %s outputs: varlen prefill and %d decode steps (the "
             "middle one planned where the scheme can be) give the "
             "host path's caches and outputs bit for bit, and the lse of the cache",
             kvq_scheme_name(s), file, c->B, tn[c->in], tn[c->out], STEPS);
    int B = c->B;
    /* batch 17's kernels run uninstrumented (runtime/cuda/cu_emu.c, KVQ_EMU_SANITIZE; 3 to 5 times faster), checked
     * by the bit-exact comparison; batch 1 runs the same (fp16-input) kernels under ASan + UBSan, batch 3 the bf16
     * ones (docs/testing.md) */
    setenv("KVQ_EMU_SANITIZE", B > 3 ? "0" : "1", 1);
    char err[1024];
    kvq_engine *eh = engine_for(s, c->in, err, sizeof err), *ed = eh ? engine_for(s, c->in, err, sizeof err) : NULL;
    TH_CHECK(eh && ed, "engines: %s", err);
    kvq_seq **sh = kvq_calloc((size_t)B, sizeof *sh), **sd = kvq_calloc((size_t)B, sizeof *sd);
    int *len = kvq_calloc((size_t)B, sizeof *len), *cu = kvq_calloc((size_t)B + 1, sizeof *cu);
    for (int i = 0; i < B; i++) {
        len[i] = 24 + (i * 37 + 11) % 140; /* 35 .. 163 */
        cu[i + 1] = cu[i] + len[i];
    }
    for (int i = 0; i < B && !th_failed(); i++)
        TH_CHECK(kvq_seq_create(eh, &sh[i]) == KVQ_OK && kvq_seq_create(ed, &sd[i]) == KVQ_OK, "seq");
    /* prefill: host items [heads][T][D]; device: one fused varlen buffer */
    uint16_t *fused = th_failed() ? NULL : dev_alloc(ed, (size_t)cu[B] * ROW * D * 2);
    TH_CHECK(th_failed() || fused, "device buffer");
    for (int l = 0; l < LAYERS && !th_failed(); l++) {
        kvq_prefill_item *it = kvq_calloc((size_t)B, sizeof *it);
        uint16_t **hb = kvq_calloc((size_t)B * 3, sizeof *hb);
        for (int i = 0; i < B; i++) {
            int T = len[i];
            for (int w = 0; w < 3; w++) {
                int heads = w == 2 ? HQ : H;
                hb[3 * i + w] = kvq_malloc((size_t)heads * T * D * 2);
                for (int h = 0; h < heads; h++)
                    for (int t = 0; t < T; t++)
                        for (int d = 0; d < D; d++)
                            hb[3 * i + w][((size_t)h * T + t) * D + d] = to16(c->in, syn_row(syn, w, l, h, t + i % 7)[d]);
            }
            it[i] = (kvq_prefill_item){sh[i], T, hb[3 * i], hb[3 * i + 1], hb[3 * i + 2]};
            for (int t = 0; t < T; t++) fill_fused(fused + ((size_t)cu[i] + t) * ROW * D, syn, c->in, l, t + i % 7);
        }
        TH_CHECK(kvq_prefill(eh, l, it, B) == KVQ_OK, "host prefill: %s", kvq_engine_errmsg(eh));
        kvq_dev_prefill dp = {sd, B, cu, view(fused, c->in, 0, ROW * D, D), view(fused, c->in, HQ, ROW * D, D),
                              view(fused, c->in, HQ + H, ROW * D, D), NULL};
        TH_CHECK(kvq_prefill_device(ed, l, &dp) == KVQ_OK, "device prefill: %s", kvq_engine_errmsg(ed));
        for (int x = 0; x < 3 * B; x++) kvq_free(hb[x]);
        kvq_free(hb), kvq_free(it);
    }
    /* decode steps */
    size_t osz = c->out == KVQ_F32 ? 4 : 2, orow = (size_t)HQ * (D + OPAD);
    uint16_t *din = th_failed() ? NULL : dev_alloc(ed, (size_t)B * ROW * D * 2);
    unsigned char *dout = th_failed() ? NULL : dev_alloc(ed, (size_t)B * orow * osz);
    float *dlse = th_failed() ? NULL : dev_alloc(ed, (size_t)B * HQ * 4);
    float *hin = kvq_malloc((size_t)B * ROW * D * 4), *hout = kvq_malloc((size_t)B * HQ * D * 4);
    uint16_t *hin16 = kvq_malloc((size_t)B * ROW * D * 2);
    kvq_decode_item *di = kvq_calloc((size_t)B, sizeof *di);
    long mismatches = 0;
    double worst_lse = 0;
    /* odd steps planned (kvq_decode_plan, kvq_decode_run: kvq_step_in's stores read the caller's rows in its
     * dtype) where the scheme can be; a ZipCache class without a window is refused and runs eager */
    int planned = !th_failed() && kvq_engine_reserve_step(ed, B, 512) == KVQ_OK, runs = 0;
    for (int st = 0; st < STEPS && !th_failed(); st++)
        for (int l = 0; l < LAYERS && !th_failed(); l++) {
            const int plan_now = planned && st % 2;
            if (plan_now && l == 0) {
                kvq_status ps = kvq_decode_plan(ed, sd, B, NULL);
                if (ps == KVQ_ERR_UNSUPPORTED)
                    planned = 0;
                else
                    TH_CHECK(ps == KVQ_OK, "plan: %s", kvq_engine_errmsg(ed));
            }
            for (int i = 0; i < B; i++) {
                int t = len[i] + st + i % 7;
                fill_fused(din + (size_t)i * ROW * D, syn, c->in, l, t);
                fill_fused(hin16 + (size_t)i * ROW * D, syn, c->in, l, t);
                uint16_t *r = hin16 + (size_t)i * ROW * D;
                di[i] = (kvq_decode_item){sh[i], r + HQ * D, r + (HQ + H) * D, r, hout + (size_t)i * HQ * D};
            }
            TH_CHECK(kvq_decode(eh, l, di, B) == KVQ_OK, "host decode: %s", kvq_engine_errmsg(eh));
            kvq_dev_decode dd = {sd,
                                 B,
                                 view(din, c->in, 0, ROW * D, D),
                                 view(din, c->in, HQ, ROW * D, D),
                                 view(din, c->in, HQ + H, ROW * D, D),
                                 {dout, c->out, (long long)orow, D + OPAD},
                                 dlse,
                                 NULL};
            if (planned && plan_now) {
                TH_CHECK(kvq_decode_run(ed, l, &dd) == KVQ_OK, "planned run: %s", kvq_engine_errmsg(ed));
                runs++;
            } else {
                TH_CHECK(kvq_decode_device(ed, l, &dd) == KVQ_OK, "device decode: %s", kvq_engine_errmsg(ed));
            }
            for (int i = 0; i < B && !th_failed(); i++)
                for (int h = 0; h < HQ; h++)
                    for (int d = 0; d < D; d++) {
                        float want = hout[((size_t)i * HQ + h) * D + d];
                        size_t at = (size_t)i * orow + (size_t)h * (D + OPAD) + d;
                        int same = c->out == KVQ_F32 ? !memcmp(&want, (float *)dout + at, 4)
                                                     : ((uint16_t *)dout)[at] == to16(c->out, want);
                        mismatches += !same;
                    }
            /* lse: the natural log-sum-exp of the scaled scores over the cache as read back (quantized layers) */
            for (int i = 0; i < B && !th_failed() && kvq_engine_layer_state(ed, l) == KVQ_LAYER_QUANTIZED; i++) {
                int n = kvq_seq_length(sd[i], l), got = 0;
                float *k = kvq_malloc((size_t)H * n * D * 4), *v = kvq_malloc((size_t)H * n * D * 4);
                TH_CHECK(kvq_seq_read_cache(ed, sd[i], l, k, v, n, &got) == KVQ_OK && got == n, "read_cache");
                const uint16_t *q = hin16 + (size_t)i * ROW * D;
                for (int h = 0; h < HQ && !th_failed(); h++) {
                    double m = -INFINITY, z = 0, sc[TOK + 8];
                    for (int t = 0; t < n && t < TOK + 8; t++) {
                        double dot = 0;
                        for (int d = 0; d < D; d++)
                            dot += (double)(c->in == KVQ_BF16 ? kvq_f32_from_bf16(q[h * D + d])
                                                              : kvq_f32_from_f16(q[h * D + d])) *
                                   k[((size_t)(h / (HQ / H)) * n + t) * D + d];
                        sc[t] = dot / sqrt((double)D);
                        if (sc[t] > m) m = sc[t];
                    }
                    for (int t = 0; t < n && t < TOK + 8; t++) z += exp(sc[t] - m);
                    double want = m + log(z), e = fabs(want - dlse[i * HQ + h]) / (1 + fabs(want));
                    if (e > worst_lse) worst_lse = e;
                }
                kvq_free(k), kvq_free(v);
            }
        }
    if (runs) printf("  %d of %d layer steps planned\n", runs, STEPS * LAYERS);
    TH_CHECK(mismatches == 0, "%ld output elements differ from the host path's", mismatches);
    TH_CHECK(worst_lse < 1e-4, "lse off by %.3g (relative)", worst_lse);
    /* caches */
    for (int l = 0; l < LAYERS && !th_failed(); l++)
        for (int i = 0; i < B; i++) {
            int cap = len[i] + STEPS, n1 = 0, n2 = 0;
            size_t sz = (size_t)H * cap * D;
            float *k1 = kvq_calloc(sz, 4), *v1 = kvq_calloc(sz, 4), *k2 = kvq_calloc(sz, 4), *v2 = kvq_calloc(sz, 4);
            TH_CHECK(kvq_seq_read_cache(eh, sh[i], l, k1, v1, cap, &n1) == KVQ_OK &&
                         kvq_seq_read_cache(ed, sd[i], l, k2, v2, cap, &n2) == KVQ_OK,
                     "read_cache");
            TH_CHECK(n1 == cap && n2 == cap && !memcmp(k1, k2, sz * 4) && !memcmp(v1, v2, sz * 4),
                     "layer %d sequence %d: caches differ (%d / %d tokens)", l, i, n1, n2);
            kvq_free(k1), kvq_free(v1), kvq_free(k2), kvq_free(v2);
        }
    kvq_mem_stats a, b;
    TH_CHECK(th_failed() || (kvq_engine_stats(eh, &a) == KVQ_OK && kvq_engine_stats(ed, &b) == KVQ_OK &&
                             !memcmp(&a, &b, sizeof a)),
             "statistics differ");
    if (ed) dev_free(ed, fused), dev_free(ed, din), dev_free(ed, dout), dev_free(ed, dlse);
    kvq_free(hin), kvq_free(hout), kvq_free(hin16), kvq_free(di);
    kvq_free(sh), kvq_free(sd), kvq_free(len), kvq_free(cu);
    kvq_engine_free(eh);
    kvq_engine_free(ed);
    th_end();
}

/* The entry points' checks, and a step on a caller's stream in capture mode. */
static void test_checks(const kvq_scheme *s, const kvq_synth *syn)
{
    th_begin("device tensors: bad batches are refused with a message; a reference engine has none; a decode step "
             "on a caller's stream runs whole in capture mode");
    char err[512];
    kvq_engine *e = engine_for(s, KVQ_F16, err, sizeof err);
    TH_CHECK(e != NULL, "engine: %s", err);
    if (!e) return;
    kvq_seq *sq[2] = {0};
    TH_CHECK(kvq_seq_create(e, &sq[0]) == KVQ_OK && kvq_seq_create(e, &sq[1]) == KVQ_OK, "seq");
    uint16_t *buf = dev_alloc(e, (size_t)64 * ROW * D * 2);
    float *lse = dev_alloc(e, 2 * HQ * 4);
    kvq_dev_tensor q = view(buf, KVQ_F16, 0, ROW * D, D), k = view(buf, KVQ_F16, HQ, ROW * D, D),
                   v = view(buf, KVQ_F16, HQ + H, ROW * D, D), o = {buf, KVQ_F32, HQ * D, D};
    kvq_dev_decode dd = {sq, 2, q, k, v, o, NULL, NULL};
    TH_CHECK(kvq_decode_device(e, 0, &dd) == KVQ_ERR_STATE && strstr(kvq_engine_errmsg(e), "not been prefilled"),
             "unprefilled: %s", kvq_engine_errmsg(e));
    int cu[3] = {0, 30, 30};
    kvq_dev_prefill dp = {sq, 2, cu, q, k, v, NULL};
    TH_CHECK(kvq_prefill_device(e, 0, &dp) == KVQ_ERR_SHAPE && strstr(kvq_engine_errmsg(e), "cu_seqlens"),
             "empty prompt: %s", kvq_engine_errmsg(e));
    cu[2] = 64;
    dp.k.dtype = KVQ_BF16;
    TH_CHECK(kvq_prefill_device(e, 0, &dp) == KVQ_ERR_INVALID && strstr(kvq_engine_errmsg(e), "dtype"),
             "dtype: %s", kvq_engine_errmsg(e));
    dp.k.dtype = KVQ_F16;
    dp.v.data = NULL;
    TH_CHECK(kvq_prefill_device(e, 0, &dp) == KVQ_ERR_INVALID && strstr(kvq_engine_errmsg(e), "v.data"),
             "NULL v: %s", kvq_engine_errmsg(e));
    dp.v = v;
    memset(buf, 0, (size_t)64 * ROW * D * 2);
    for (int l = 0; l < LAYERS; l++) {
        for (int t = 0; t < 64; t++) fill_fused(buf + (size_t)t * ROW * D, syn, KVQ_F16, l, t);
        TH_CHECK(kvq_prefill_device(e, l, &dp) == KVQ_OK, "prefill: %s", kvq_engine_errmsg(e));
    }
    dd.out.head_stride = 4;
    TH_CHECK(kvq_decode_device(e, 0, &dd) == KVQ_ERR_INVALID && strstr(kvq_engine_errmsg(e), "overlap"),
             "overlapping out: %s", kvq_engine_errmsg(e));
    dd.out = o;
    dd.out.data = dev_alloc(e, 2 * HQ * D * 4);
    dd.lse = lse;
    dd.stream = (void *)(uintptr_t)0x5eed; /* a caller's stream (the emulator's streams are tokens) */
    for (int st = 0; st < 2 && !th_failed(); st++) {
        for (int i = 0; i < 2; i++) fill_fused(buf + (size_t)i * ROW * D, syn, KVQ_F16, 0, 64 + st + i);
        cu_dev_counters c0, c1, x;
        cu_dev_counters_get(&c0);
        if (st == 1) cu_dev_capture(1); /* the first step warms up (scratch) */
        for (int l = 0; l < LAYERS && !th_failed(); l++)
            TH_CHECK(kvq_decode_device(e, l, &dd) == KVQ_OK, "step %d layer %d: %s", st, l, kvq_engine_errmsg(e));
        cu_dev_capture(0);
        cu_dev_counters_get(&c1);
        cu_dev_counters_diff(&c1, &c0, &x);
        if (st == 1)
            TH_CHECK(x.capture_refused == 0 && x.syncs == 0 && x.d2h == 0 && x.allocs == 0 && x.launches > 0,
                     "captured step: refused %ld syncs %ld d2h %ld allocs %ld launches %ld", x.capture_refused,
                     x.syncs, x.d2h, x.allocs, x.launches);
    }
    TH_CHECK(cu_dev_stream(e->ctx->dev) == e->ctx->dev->own_stream, "the engine's own stream is back after the call");
    dev_free(e, dd.out.data);
    dev_free(e, buf), dev_free(e, lse);
    kvq_engine_free(e);
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){LAYERS, HQ, H, D};
    kvq_engine *r = NULL;
    TH_CHECK(kvq_engine_create(s, &cfg, &r, err, sizeof err) == KVQ_OK, "reference: %s", err);
    kvq_seq *rs = NULL;
    if (r && kvq_seq_create(r, &rs) == KVQ_OK) {
        kvq_dev_prefill rp = {&rs, 1, cu, q, k, v, NULL};
        TH_CHECK(kvq_prefill_device(r, 0, &rp) == KVQ_ERR_UNSUPPORTED && strstr(kvq_engine_errmsg(r), "no device"),
                 "reference: %s", kvq_engine_errmsg(r));
    }
    kvq_engine_free(r);
    th_end();
}

int main(void)
{
    kvq_synth_params sp = kvq_synth_params_default();
    sp.layers = LAYERS, sp.kv_heads = H, sp.heads = HQ, sp.head_dim = D, sp.tokens = TOK, sp.seed = 9;
    kvq_synth syn;
    char err[512];
    if (kvq_synth_generate(&sp, &syn, err, sizeof err) != KVQ_OK) {
        th_begin("device tensors: synthetic data");
        TH_CHECK(0, "synth: %s", err);
        th_end();
        return th_summary();
    }
    kvq_spec *k2 = NULL;
    if (kvq_spec_parse_file(th_path("specs/kivi2.kvq"), &k2) == KVQ_OK) {
        kvq_engine *probe = engine_for(kvq_spec_scheme_at(k2, 0), KVQ_F16, err, sizeof err);
        if (!probe) {
            printf("SKIP device tensors: %s\n", err);
            kvq_spec_free(k2);
            kvq_synth_free(&syn);
            return 0;
        }
        kvq_engine_free(probe);
        test_checks(kvq_spec_scheme_at(k2, 0), &syn);
    }
    kvq_spec_free(k2);
    char *names[64];
    int n = th_list_files("specs", ".kvq", names, 64);
    const dcase cases[] = {{1, KVQ_F16, KVQ_F32}, {3, KVQ_BF16, KVQ_BF16}, {17, KVQ_F16, KVQ_F16}};
    for (int f = 0; f < n; f++) {
        char rel[300];
        snprintf(rel, sizeof rel, "specs/%s", names[f]);
        kvq_spec *spec = NULL;
        if (kvq_spec_parse_file(th_path(rel), &spec) == KVQ_OK)
            for (int i = 0; i < kvq_spec_scheme_count(spec); i++)
                for (size_t x = 0; x < sizeof cases / sizeof cases[0]; x++) {
                    /* batch 17 (the fused varlen buffer of many sequences, chunks split over them) for one spec of
                     * each decode path: KIVI-2's pages, OTT's pools and TailorKV's sparse host offload; every spec's
                     * kernels run at batches 1 and 3 (issue 19: the batch-17 runs were most of this program) */
                    const int wide = !strcmp(names[f], "kivi2.kvq") || !strcmp(names[f], "ott.kvq") ||
                                     !strcmp(names[f], "tailorkv2.kvq");
                    if (cases[x].B > 3 && !wide) continue;
                    run_case(rel, kvq_spec_scheme_at(spec, i), &syn, &cases[x]);
                }
        kvq_spec_free(spec);
        free(names[f]);
    }
    kvq_synth_free(&syn);
    return th_summary();
}
