/* The GPU serving path's host protocol under the emulator (docs/cuda.md "The host protocol"):
 * - the device layer's counters (cu_counters.h) count what each call costs, and the emulated capture mode refuses
 *   exactly the calls CUDA graph capture refuses;
 * - for every spec in specs/, after warm-up a decode step of every layer of a batch makes no allocation and no
 *   free (device or page-locked), no module load, and through the host-pointer API exactly one synchronisation
 *   and one device-to-host copy per layer (its outputs), ZipCache's compressions included (their classes stay on
 *   the device: variants of specs/zipcache.kvq compressing every 3 and every 7 tokens put compressions in the
 *   measured steps and in the captured step, which is asserted); OTT's competitions (one falls in the measured
 *   steps) keep their counts on the device;
 * - the same step's device work (cu_decode_enqueue: append, plan, attend, policies, outputs left on the device)
 *   runs whole in capture mode, and its outputs and caches equal, bit for bit, those of an engine that took the
 *   host-pointer path. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "cuda/cu_backend.h"
#include "cuda/cu_counters.h"
#include "cuda/cu_dev.h"
#include "harness.h"
#include "kvq.h"
#include "rt_internal.h"
#include "synth.h"

#define LAYERS 3
#define H 2
#define HQ 4
#define D 128
#define NB 3
#define TOK 300
#define WARM 2
#define MEAS 4

/* lengths whose flushes fall in the measured steps: KIVI keys at R = 128 (252) and R = 32 (157), OTT's group
 * of 128 behind a residual of 32 (157: the window reaches 160 at step 2) */
static const int prompt[NB] = {252, 190, 157};

/* ---- the device layer ---- */

static void test_counters_and_capture(void)
{
    th_begin("emulated device: counters of allocations, copies and synchronisations; capture mode refuses what "
             "graph capture refuses and allows launches' companions (async copies with page-locked memory, memsets)");
    cu_dev *d = NULL;
    char msg[512];
    if (cu_dev_open(CU_DEV_EMU, &d, msg, sizeof msg) != KVQ_OK) {
        printf("SKIP emulated device: %s\n", msg);
        return;
    }
    cu_dev_counters c0, c1, x;
    cu_dev_counters_get(&c0);
    uint64_t a = 0, hd = 0;
    void *pinned = NULL;
    float pageable[64] = {1, 2, 3};
    TH_CHECK(cu_dev_alloc(d, 256, &a, msg, sizeof msg) == KVQ_OK, "alloc: %s", msg);
    TH_CHECK(cu_dev_alloc_host(d, 256, &pinned, &hd, msg, sizeof msg) == KVQ_OK, "alloc_host: %s", msg);
    TH_CHECK(cu_dev_h2d(d, a, pageable, sizeof pageable, msg, sizeof msg) == KVQ_OK, "h2d: %s", msg);
    TH_CHECK(cu_dev_d2h(d, pageable, a, sizeof pageable, msg, sizeof msg) == KVQ_OK, "d2h: %s", msg);
    TH_CHECK(cu_dev_h2d_async(d, a, pinned, 128, msg, sizeof msg) == KVQ_OK, "h2d_async: %s", msg);
    TH_CHECK(cu_dev_d2h_async(d, pinned, a, 128, msg, sizeof msg) == KVQ_OK, "d2h_async pinned: %s", msg);
    TH_CHECK(cu_dev_d2h_async(d, pageable, a, 128, msg, sizeof msg) == KVQ_OK, "d2h_async pageable: %s", msg);
    TH_CHECK(cu_dev_memset(d, a, 0, 256, msg, sizeof msg) == KVQ_OK, "memset: %s", msg);
    TH_CHECK(cu_dev_sync(d, msg, sizeof msg) == KVQ_OK, "sync: %s", msg);
    cu_dev_counters_get(&c1);
    cu_dev_counters_diff(&c1, &c0, &x);
    /* syncs: h2d, d2h (synchronous), the pageable async copy, the explicit one */
    TH_CHECK(x.allocs == 1 && x.host_allocs == 1 && x.h2d == 2 && x.d2h == 3 && x.syncs == 4 && x.memsets == 1,
             "counted allocs %ld host_allocs %ld h2d %ld d2h %ld syncs %ld memsets %ld", x.allocs, x.host_allocs,
             x.h2d, x.d2h, x.syncs, x.memsets);
    TH_CHECK(cu_dev_is_pinned(d, (char *)pinned + 16, 240) && !cu_dev_is_pinned(d, (char *)pinned + 16, 241) &&
                 !cu_dev_is_pinned(d, pageable, 4),
             "page-locked ranges");

    cu_dev_capture(1);
    cu_dev_counters_get(&c0);
    uint64_t b = 0;
    struct {
        const char *what;
        kvq_status st;
    } refused[] = {
        {"cuMemAlloc", cu_dev_alloc(d, 256, &b, msg, sizeof msg)},
        {"cuStreamSynchronize", cu_dev_sync(d, msg, sizeof msg)},
        {"cuMemcpyHtoD (synchronous)", cu_dev_h2d(d, a, pageable, 16, msg, sizeof msg)},
        {"cuMemcpyDtoH (synchronous)", cu_dev_d2h(d, pageable, a, 16, msg, sizeof msg)},
        {"cuMemcpyDtoHAsync into pageable", cu_dev_d2h_async(d, pageable, a, 16, msg, sizeof msg)},
        {"cuMemcpyHtoDAsync from pageable", cu_dev_h2d_async(d, a, pageable, 16, msg, sizeof msg)},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++)
        TH_CHECK(refused[i].st == KVQ_ERR_INTERNAL, "%s was not refused in capture", refused[i].what);
    TH_CHECK(strstr(msg, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED") && strstr(msg, "cuMemcpyHtoDAsync"),
             "message: %s", msg);
    TH_CHECK(b == 0, "a refused allocation returned memory");
    TH_CHECK(cu_dev_h2d_async(d, a, pinned, 64, msg, sizeof msg) == KVQ_OK &&
                 cu_dev_d2h_async(d, pinned, a, 64, msg, sizeof msg) == KVQ_OK &&
                 cu_dev_memset(d, a, 0, 64, msg, sizeof msg) == KVQ_OK,
             "allowed in capture: %s", msg);
    cu_dev_counters_get(&c1);
    cu_dev_capture(0);
    cu_dev_counters_diff(&c1, &c0, &x);
    TH_CHECK(x.capture_refused == 6 && x.allocs == 0 && x.syncs == 0, "refused %ld, allocs %ld, syncs %ld",
             x.capture_refused, x.allocs, x.syncs);
    TH_CHECK(cu_dev_sync(d, msg, sizeof msg) == KVQ_OK, "sync after capture: %s", msg);
    cu_dev_free_host(d, pinned);
    cu_dev_free(d, a);
    cu_dev_close(d);
    th_end();
}

/* ---- decode steps of every spec ---- */

static kvq_engine *engine_for(const kvq_scheme *s, char *err, size_t n)
{
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){LAYERS, HQ, H, D};
    cfg.dtype = KVQ_F32;
    cfg.backend = KVQ_BACKEND_EMU;
    kvq_engine *e = NULL;
    return kvq_engine_create(s, &cfg, &e, err, n) == KVQ_OK ? e : NULL;
}

static int prefill_all(kvq_engine *e, kvq_seq **sq, const kvq_synth *syn)
{
    for (int l = 0; l < LAYERS; l++) {
        kvq_prefill_item it[NB];
        float *buf[NB][3];
        for (int i = 0; i < NB; i++) {
            int T = prompt[i];
            buf[i][0] = kvq_malloc((size_t)H * T * D * 4), buf[i][1] = kvq_malloc((size_t)H * T * D * 4);
            buf[i][2] = kvq_malloc((size_t)HQ * T * D * 4);
            for (int h = 0; h < HQ; h++) {
                if (h < H) {
                    memcpy(buf[i][0] + (size_t)h * T * D, syn->k + (((size_t)l * H + h) * TOK) * D, (size_t)T * D * 4);
                    memcpy(buf[i][1] + (size_t)h * T * D, syn->v + (((size_t)l * H + h) * TOK) * D, (size_t)T * D * 4);
                }
                memcpy(buf[i][2] + (size_t)h * T * D, syn->q + (((size_t)l * HQ + h) * TOK) * D, (size_t)T * D * 4);
            }
            it[i] = (kvq_prefill_item){sq[i], T, buf[i][0], buf[i][1], buf[i][2]};
        }
        kvq_status st = kvq_prefill(e, l, it, NB);
        for (int i = 0; i < NB; i++)
            for (int x = 0; x < 3; x++) kvq_free(buf[i][x]);
        if (st != KVQ_OK) return 0;
    }
    return 1;
}

/* The inputs of step s of layer l for the batch: in [NB][k H*D | v H*D | q HQ*D]. */
static void step_inputs(const kvq_synth *syn, int l, int s, float *in)
{
    for (int i = 0; i < NB; i++) {
        float *k = in + (size_t)i * (2 * H + HQ) * D, *v = k + H * D, *q = v + H * D;
        size_t t = (size_t)prompt[i] + s;
        for (int h = 0; h < H; h++) {
            memcpy(k + h * D, syn->k + (((size_t)l * H + h) * TOK + t) * D, D * 4);
            memcpy(v + h * D, syn->v + (((size_t)l * H + h) * TOK + t) * D, D * 4);
        }
        for (int h = 0; h < HQ; h++) memcpy(q + h * D, syn->q + (((size_t)l * HQ + h) * TOK + t) * D, D * 4);
    }
}

static int decode_host(kvq_engine *e, kvq_seq **sq, const kvq_synth *syn, int s, float *out)
{
    float *in = kvq_malloc((size_t)NB * (2 * H + HQ) * D * 4);
    int ok = in != NULL;
    for (int l = 0; l < LAYERS && ok; l++) {
        step_inputs(syn, l, s, in);
        kvq_decode_item it[NB];
        for (int i = 0; i < NB; i++) {
            float *k = in + (size_t)i * (2 * H + HQ) * D;
            it[i] = (kvq_decode_item){sq[i], k, k + H * D, k + 2 * H * D, out + ((size_t)l * NB + i) * HQ * D};
        }
        ok = kvq_decode(e, l, it, NB) == KVQ_OK;
    }
    kvq_free(in);
    return ok;
}

/* Tokens waiting in fp16 windows over the engine (a drop across a step: a compression or flush left them). */
static uint64_t residual_tokens(const kvq_engine *e)
{
    kvq_mem_stats ms;
    return kvq_engine_stats(e, &ms) == KVQ_OK ? ms.tokens[KVQ_SEG_RESIDUAL] : 0;
}

/* comp[0]: measured steps in which windows flushed (residual tokens dropped), comp[1]: 1 if the captured one did. */
static void run_scheme(const char *file, const kvq_scheme *s, const kvq_synth *syn, int comp[2])
{
    const char *name = kvq_scheme_name(s);
    th_begin("serving step: %s (%s): after kvq_engine_reserve_step and warm-up no allocation, free or load in a "
             "decode step, one sync and one device-to-host copy per layer (the outputs); the step's device work runs "
             "whole in capture mode and equals the host-pointer path bit for bit",
             name, file);
    char err[1024];
    kvq_engine *e = engine_for(s, err, sizeof err), *ctl = e ? engine_for(s, err, sizeof err) : NULL;
    TH_CHECK(e && ctl, "engine: %s", err);
    kvq_seq *sq[NB] = {0}, *sc[NB] = {0};
    for (int i = 0; i < NB && e && ctl; i++)
        TH_CHECK(kvq_seq_create(e, &sq[i]) == KVQ_OK && kvq_seq_create(ctl, &sc[i]) == KVQ_OK, "seq");
    if (!th_failed())
        TH_CHECK(prefill_all(e, sq, syn) && prefill_all(ctl, sc, syn), "prefill: %s / %s", kvq_engine_errmsg(e),
                 kvq_engine_errmsg(ctl));
    /* A serving loop reserves its steps (kvq.h: after kvq_engine_reserve_step no step allocates); without it a
     * step whose tile list or scratch crosses a doubling allocates, which is allowed. */
    if (!th_failed())
        TH_CHECK(kvq_engine_reserve_step(e, NB, 252 + WARM + MEAS + 2) == KVQ_OK, "reserve_step: %s",
                 kvq_engine_errmsg(e));
    size_t od = (size_t)LAYERS * NB * HQ * D;
    float *out = kvq_malloc(od * 4), *oc = kvq_malloc(od * 4);
    comp[0] = comp[1] = 0;
    uint64_t resid = e ? residual_tokens(e) : 0;
    for (int st = 0; st < WARM + MEAS && !th_failed(); st++) {
        cu_dev_counters c0, c1, x;
        cu_dev_counters_get(&c0);
        TH_CHECK(decode_host(e, sq, syn, st, out), "step %d: %s", st, kvq_engine_errmsg(e));
        cu_dev_counters_get(&c1);
        TH_CHECK(decode_host(ctl, sc, syn, st, oc), "control step %d: %s", st, kvq_engine_errmsg(ctl));
        uint64_t r = residual_tokens(e); /* outside the counted step: stats may synchronise */
        if (st >= WARM && r < resid) comp[0]++;
        resid = r;
        if (st < WARM) continue;
        cu_dev_counters_diff(&c1, &c0, &x);
        TH_CHECK(x.allocs == 0 && x.frees == 0 && x.host_allocs == 0 && x.host_frees == 0 && x.loads == 0,
                 "step %d: allocs %ld frees %ld host allocs %ld host frees %ld loads %ld", st, x.allocs, x.frees,
                 x.host_allocs, x.host_frees, x.loads);
        TH_CHECK(x.launches > 0, "step %d: no launch counted", st);
        TH_CHECK(x.syncs == LAYERS && x.d2h == LAYERS, "step %d: syncs %ld, d2h %ld (want %d each)", st, x.syncs,
                 x.d2h, LAYERS);
    }
    /* one step of every layer in capture mode through cu_decode_enqueue; the control through kvq_decode */
    int cs = WARM + MEAS;
    float *in = kvq_malloc((size_t)NB * (2 * H + HQ) * D * 4);
    for (int l = 0; l < LAYERS && !th_failed(); l++) {
        step_inputs(syn, l, cs, in);
        kvq_be_decode bi[NB];
        for (int i = 0; i < NB; i++) {
            float *k = in + (size_t)i * (2 * H + HQ) * D;
            bi[i] = (kvq_be_decode){sq[i]->bseq, k, k + H * D, k + 2 * H * D, NULL};
        }
        char msg[1024] = "";
        uint64_t outd = 0;
        cu_dev_counters c0, c1, x;
        cu_ctx_scope scope;
        cu_dev_enter(e->ctx->dev, &scope);
        cu_dev_counters_get(&c0);
        cu_dev_capture(1);
        kvq_status st = cu_decode_enqueue(e->ctx, l, bi, NB, &outd, msg, sizeof msg);
        cu_dev_capture(0);
        cu_dev_counters_get(&c1);
        cu_dev_leave(e->ctx->dev, &scope);
        cu_dev_counters_diff(&c1, &c0, &x);
        TH_CHECK(st == KVQ_OK, "layer %d in capture: %s", l, msg);
        TH_CHECK(x.capture_refused == 0 && x.syncs == 0 && x.d2h == 0 && x.allocs == 0,
                 "layer %d in capture: refused %ld syncs %ld d2h %ld allocs %ld", l, x.capture_refused, x.syncs,
                 x.d2h, x.allocs);
        if (st == KVQ_OK) /* the emulator's device memory is host memory */
            memcpy(out + (size_t)l * NB * HQ * D, (const void *)(uintptr_t)outd, (size_t)NB * HQ * D * 4);
    }
    kvq_free(in);
    if (!th_failed() && residual_tokens(e) < resid) comp[1] = 1;
    TH_CHECK(th_failed() || decode_host(ctl, sc, syn, cs, oc), "control: %s", kvq_engine_errmsg(ctl));
    if (!th_failed()) TH_CHECK(!memcmp(out, oc, od * 4), "captured step's outputs differ from the host path's");
    for (int l = 0; l < LAYERS && !th_failed(); l++)
        for (int i = 0; i < NB; i++) {
            int cap = prompt[i] + cs + 1, n1 = 0, n2 = 0;
            size_t sz = (size_t)H * cap * D;
            float *k1 = kvq_malloc(sz * 4), *v1 = kvq_malloc(sz * 4), *k2 = kvq_calloc(sz, 4), *v2 = kvq_calloc(sz, 4);
            memset(k1, 0, sz * 4), memset(v1, 0, sz * 4);
            TH_CHECK(kvq_seq_read_cache(e, sq[i], l, k1, v1, cap, &n1) == KVQ_OK &&
                         kvq_seq_read_cache(ctl, sc[i], l, k2, v2, cap, &n2) == KVQ_OK,
                     "read_cache: %s", kvq_engine_errmsg(e));
            TH_CHECK(n1 == cap && n2 == cap && !memcmp(k1, k2, sz * 4) && !memcmp(v1, v2, sz * 4),
                     "layer %d sequence %d: caches differ (%d / %d tokens)", l, i, n1, n2);
            kvq_free(k1), kvq_free(v1), kvq_free(k2), kvq_free(v2);
        }
    kvq_free(out), kvq_free(oc);
    kvq_engine_free(e);
    kvq_engine_free(ctl);
    th_end();
}

/* specs/zipcache.kvq compressing every 3 tokens (compressions in measured steps 2 and 5) and every 7 (in the
 * captured step 6): the compression steps make no device-to-host copy or synchronisation of their own and run whole
 * in capture mode, with the host path's caches (read_cache derives the slots' positions from the device). */
static void test_zip_compressions(const kvq_synth *syn)
{
    static const struct {
        int every, measured, captured;
    } v[] = {{3, 2, 0}, {7, 0, 1}};
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        char text[512], label[64];
        snprintf(text, sizeof text,
                 "scheme zipcache_every%d {\n  key { per channel; group all; }\n"
                 "  value { per token; channel_separable; group hidden; }\n"
                 "  saliency normalized { probes recent 5%% random 5%%; salient 60%% bits 4; rest bits 2; every %d; }\n"
                 "}\n",
                 v[i].every, v[i].every);
        snprintf(label, sizeof label, "specs/zipcache.kvq, every %d", v[i].every);
        kvq_spec *spec = NULL;
        int comp[2] = {-1, -1};
        if (kvq_spec_parse_string(label, text, strlen(text), &spec) == KVQ_OK && kvq_spec_scheme_count(spec) == 1)
            run_scheme(label, kvq_spec_scheme_at(spec, 0), syn, comp);
        th_begin("serving step: ZipCache every %d: %d measured and %d captured compression steps", v[i].every,
                 v[i].measured, v[i].captured);
        TH_CHECK(spec && kvq_spec_error_count(spec) == 0, "the variant does not parse");
        TH_CHECK(comp[0] == v[i].measured && comp[1] == v[i].captured, "%d measured, %d captured", comp[0], comp[1]);
        th_end();
        kvq_spec_free(spec);
    }
}

/* kvq_engine_reserve_device: one slab of the asked size up front, which the cache then lives in. */
static void test_reserve(const kvq_scheme *s, const kvq_synth *syn)
{
    th_begin("kvq_engine_reserve_device: the emu engine's pool takes one slab of the asked size up front and the "
             "prefill and steps live in it; a smaller reservation takes nothing; other backends do nothing");
    char err[512];
    TH_CHECK(kvq_engine_reserve_device(NULL, 1) == KVQ_ERR_INVALID, "NULL engine");
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){LAYERS, HQ, H, D};
    cfg.dtype = KVQ_F32;
    kvq_engine *ref = NULL;
    TH_CHECK(kvq_engine_create(s, &cfg, &ref, err, sizeof err) == KVQ_OK, "reference engine: %s", err);
    if (ref) TH_CHECK(kvq_engine_reserve_device(ref, (size_t)1 << 30) == KVQ_OK, "reference: %s", kvq_engine_errmsg(ref));
    kvq_engine_free(ref);
    kvq_engine *e = engine_for(s, err, sizeof err);
    TH_CHECK(e != NULL, "engine: %s", err);
    cu_dev_counters c0, c1, x;
    cu_dev_counters_get(&c0);
    size_t want = (size_t)40 << 20;
    TH_CHECK(e && kvq_engine_reserve_device(e, want) == KVQ_OK && kvq_engine_reserve_device(e, want / 4) == KVQ_OK,
             "reserve: %s", e ? kvq_engine_errmsg(e) : "");
    cu_dev_counters_get(&c1);
    cu_dev_counters_diff(&c1, &c0, &x);
    TH_CHECK(x.allocs == 1, "%ld allocations for two reservations", x.allocs);
    kvq_seq *sq[NB] = {0};
    for (int i = 0; i < NB && e && !th_failed(); i++) TH_CHECK(kvq_seq_create(e, &sq[i]) == KVQ_OK, "seq");
    if (!th_failed()) TH_CHECK(prefill_all(e, sq, syn), "prefill: %s", kvq_engine_errmsg(e));
    float *out = kvq_malloc((size_t)LAYERS * NB * HQ * D * 4);
    for (int st = 0; st < 3 && !th_failed(); st++) TH_CHECK(decode_host(e, sq, syn, st, out), "step %d", st);
    if (e)
        TH_CHECK(e->ctx->pool.n_slabs == 1 && e->ctx->pool.total == want && e->ctx->pool.used > 0,
                 "pool: %d slabs, %zu bytes, %zu used", e->ctx->pool.n_slabs, e->ctx->pool.total, e->ctx->pool.used);
    kvq_free(out);
    kvq_engine_free(e);
    th_end();
}

int main(void)
{
    test_counters_and_capture();
    kvq_synth_params sp = kvq_synth_params_default();
    sp.layers = LAYERS, sp.kv_heads = H, sp.heads = HQ, sp.head_dim = D, sp.tokens = TOK, sp.seed = 5;
    kvq_synth syn;
    char err[512];
    if (kvq_synth_generate(&sp, &syn, err, sizeof err) != KVQ_OK) {
        th_begin("serving step: synthetic data");
        TH_CHECK(0, "synth: %s", err);
        th_end();
        return th_summary();
    }
    char *names[64];
    int n = th_list_files("specs", ".kvq", names, 64);
    th_begin("serving step: specs/ holds specs");
    TH_CHECK(n >= 8, "%d specs in %s", n, th_path("specs"));
    th_end();
    kvq_spec *kspec = NULL;
    if (kvq_spec_parse_file(th_path("specs/kivi2.kvq"), &kspec) == KVQ_OK) test_reserve(kvq_spec_scheme_at(kspec, 0), &syn);
    kvq_spec_free(kspec);
    for (int f = 0; f < n; f++) {
        char rel[300];
        snprintf(rel, sizeof rel, "specs/%s", names[f]);
        kvq_spec *spec = NULL;
        if (kvq_spec_parse_file(th_path(rel), &spec) != KVQ_OK) {
            th_begin("serving step: %s parses", rel);
            TH_CHECK(0, "parse failed");
            th_end();
        }
        int comp[2];
        for (int i = 0; spec && i < kvq_spec_scheme_count(spec); i++)
            run_scheme(rel, kvq_spec_scheme_at(spec, i), &syn, comp);
        kvq_spec_free(spec);
        free(names[f]);
    }
    test_zip_compressions(&syn);
    kvq_synth_free(&syn);
    return th_summary();
}
