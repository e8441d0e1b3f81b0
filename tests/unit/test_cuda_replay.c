/* Planned decode steps replayed as a graph (kvq.h "Planned decode steps", docs/cuda.md "Planned steps") under the
 * emulator (or on a GPU: tests/gpu/test_gpu_replay.c builds this file for the cuda backend and the driver's
 * graphs). For every spec in specs/ and batches of 1 and 3 sequences (and 17 for KIVI-2: a batch costs the emulator
 * its size in time, and the tables' per-sequence layout is the same at 3 as at 17; under the emulator batch 1 only
 * for the specs without a failure case below, whose kernels the failure case runs under ASan + UBSan) of different
 * prompt lengths (varlen prefill), 3 layers: engine A takes every step through the host-pointer kvq_decode; engine B plans every step
 * (kvq_decode_plan), runs step 0's layers eagerly (kvq_decode_run; warm-up), captures step 1's runs of every layer
 * (the emulator's capture mode records them), and for the 14 steps after (40 on a GPU; 28 for zip_fast) only writes the step's q, k, v into the
 * same device buffers, plans and replays the graph (cu_dev_graph_replay), with KIVI flushes at R = 32 and 128 and
 * new pages on the way. Each step's outputs of every layer, the final caches (read_cache) and statistics of B
 * equal A's bit for bit, and a replayed step makes no synchronisation, allocation, device-to-host copy or launch
 * by the host: the plan's one copy and the replay. The policy specs replay too, with prompts chosen so that the
 * steps cross what their policies decide: OTT's pool layer (prompts of 274 to 284 tokens: a competition in the
 * prefill, then one per sequence at steps 4, 9 and 14, so the pool-state copies flip while other sequences'
 * items are empty), TailorKV's sparse layers (prompts of 236 to 250: every step retrieves the top 128 of 172 to
 * 186 candidates; its quantized layers flush at steps 6 and 12), ZipCache (specs/zipcache.kvq: probe steps;
 * zip_fast, every 6 behind a residual of 2: 5 compressions, each classing its batch from the cycle's probe rows).
 * ZipCache without a window is refused by the plan with a message that names it. Also: a batch or a length beyond the reserved capacity is refused and changes nothing, and a plan
 * failed at every allocation and at its device copy in turn leaves every layer of every sequence as it was
 * (KIVI-2, and OTT, TailorKV and ZipCache across a competition, retrievals, probe rows and a compression).
 * The planned tiles live on the device (cu_step_tiles.c): after every step each sequence's device list of each
 * layer equals what cu_qlayer_tiles builds from the layer, and its host mirror (failed plans included); a plan's
 * H2D bytes are the fixed tables plus at most PATCH_TILES tiles per sequence and layer at any context; and a long
 * case (test_join_leave) has sequences leave and join, host-path steps and a new reservation between planned
 * steps. */
#include <dlfcn.h>
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

#define LAYERS 3 /* ott.kvq: layers 0..1 without a pool, layer 2 with one */
#define H 2
#define HQ 4
#define D 128
#define TOK 240
#define STEPS 42 /* on a GPU: step 0 eager (warm-up), step 1 captured, 40 replayed */
/* Under the emulator a case costs its batch size times its steps, and each replayed step checks the same things
 * (outputs bit for bit, no sync, alloc, D2H or host launch): batches 1 and 3 take 16 steps (14 replayed), with the
 * prompts chosen so that every event of the 42 still comes in them (prompt_len: KIVI flushes by step 8, OTT's
 * three competitions at steps 4, 9 and 14, TailorKV's flushes at 6 and 12); zip_fast takes 30 (its 5 compressions,
 * one every 6 steps, asserted); batch 17 (KIVI-2 only) takes 14: 12 replayed steps still cross R = 128 key flushes
 * (its sequences of 125 and 117 tokens; the flush is asserted) and replay a warm graph. A GPU takes 42 at every
 * batch. */
#define STEPS_EMU 16
#define STEPS_ZIP 30
#define STEPS_WIDE 14
#define ROW (HQ + 2 * H) /* heads of a fused qkv row */

/* ---- "device" memory of the engine's emulated device (its addresses are host addresses) ---- */

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

/* Bytes to and from device memory (synchronous copies: outside the measured calls). */
static int dev_copy(kvq_engine *e, void *dst, const void *src, size_t bytes, int to_device)
{
    cu_ctx_scope s;
    char msg[256];
    cu_dev_enter(e->ctx->dev, &s);
    kvq_status st = to_device ? cu_dev_h2d(e->ctx->dev, (uint64_t)(uintptr_t)dst, src, bytes, msg, sizeof msg)
                              : cu_dev_d2h(e->ctx->dev, dst, (uint64_t)(uintptr_t)src, bytes, msg, sizeof msg);
    cu_dev_leave(e->ctx->dev, &s);
    return st == KVQ_OK;
}

/* ---- the graph: the emulator's recorded one (cu_counters.h), or on a GPU the driver's stream capture of the
 * engine's own stream, instantiated and launched (libcuda through dlopen, CUDA 12 entry points) ---- */

#ifndef CU_TEST_BACKEND
#define CU_TEST_BACKEND KVQ_BACKEND_EMU
#endif
#define ON_GPU (CU_TEST_BACKEND == KVQ_BACKEND_CUDA)

static struct {
    int (*begin)(void *, int);
    int (*end)(void *, void **);
    int (*inst)(void **, void *, unsigned long long);
    int (*launch)(void *, void *);
    int (*exec_destroy)(void *);
    int (*destroy)(void *);
    void *graph, *exec;
} gr;

static int graph_begin(kvq_engine *e)
{
    if (!ON_GPU) {
        cu_dev_capture(1); /* records the emulated graph */
        return 1;
    }
    const char *lib = getenv("KVQ_LIBCUDA"); /* the driver the engines use (a fake one in the bundle's pre-fill) */
    void *h = dlopen(lib && *lib ? lib : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return 0;
    *(void **)&gr.begin = dlsym(h, "cuStreamBeginCapture_v2");
    *(void **)&gr.end = dlsym(h, "cuStreamEndCapture");
    *(void **)&gr.inst = dlsym(h, "cuGraphInstantiateWithFlags");
    *(void **)&gr.launch = dlsym(h, "cuGraphLaunch");
    *(void **)&gr.exec_destroy = dlsym(h, "cuGraphExecDestroy");
    *(void **)&gr.destroy = dlsym(h, "cuGraphDestroy");
    if (!gr.begin || !gr.end || !gr.inst || !gr.launch || !gr.exec_destroy || !gr.destroy) return 0;
    /* the test's own driver calls need the engine's context current (the library's are inside its entry points) */
    cu_ctx_scope s;
    cu_dev_enter(e->ctx->dev, &s);
    int ok = gr.begin(cu_dev_stream(e->ctx->dev), 0 /* CU_STREAM_CAPTURE_MODE_GLOBAL */) == 0;
    cu_dev_leave(e->ctx->dev, &s);
    return ok;
}

static int graph_end(kvq_engine *e)
{
    if (!ON_GPU) {
        cu_dev_capture(0);
        return cu_dev_graph_nodes() > 0;
    }
    gr.graph = gr.exec = NULL;
    cu_ctx_scope s;
    cu_dev_enter(e->ctx->dev, &s);
    int ok = gr.end(cu_dev_stream(e->ctx->dev), &gr.graph) == 0 && gr.inst(&gr.exec, gr.graph, 0) == 0;
    cu_dev_leave(e->ctx->dev, &s);
    return ok;
}

static int graph_launch(kvq_engine *e, char *msg, size_t n)
{
    if (!ON_GPU) return cu_dev_graph_replay(msg, n) == KVQ_OK;
    snprintf(msg, n, "cuGraphLaunch failed");
    if (!gr.launch || !gr.exec) return 0; /* no graph was captured (a driver without the graph API) */
    cu_ctx_scope s;
    cu_dev_enter(e->ctx->dev, &s);
    int ok = gr.launch(gr.exec, cu_dev_stream(e->ctx->dev)) == 0;
    cu_dev_leave(e->ctx->dev, &s);
    return ok;
}

static void graph_free(kvq_engine *e)
{
    if (!ON_GPU) {
        cu_dev_graph_reset();
        return;
    }
    if (e && (gr.exec || gr.graph)) {
        cu_ctx_scope s;
        cu_dev_enter(e->ctx->dev, &s);
        if (gr.exec) gr.exec_destroy(gr.exec);
        if (gr.graph) gr.destroy(gr.graph);
        cu_dev_leave(e->ctx->dev, &s);
    }
    gr.exec = gr.graph = NULL;
}

/* How the engines created next compile their kernels (the emulator's modules, when libkvq is built with the
 * sanitizers: runtime/cuda/cu_emu.c, KVQ_EMU_SANITIZE): 2 with ASan + UBSan (the failure cases), 1 with ASan only
 * (batch 1 of every spec: the kernels' memory accesses), 0 uninstrumented, 3 to 5 times faster (batches 3 and 17,
 * the long join/leave case), checked by the bit-exact comparison as every case is (docs/testing.md). */
static void sanitized_kernels(int how) { setenv("KVQ_EMU_SANITIZE", how == 2 ? "1" : how ? "address" : "0", 1); }

static kvq_engine *engine_for(const kvq_scheme *s, char *err, size_t n)
{
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){LAYERS, HQ, H, D};
    cfg.dtype = KVQ_F16;
    cfg.backend = CU_TEST_BACKEND;
    kvq_engine *e = NULL;
    return kvq_engine_create(s, &cfg, &e, err, n) == KVQ_OK ? e : NULL;
}

/* token t of layer l: [heads][D] of tensor w (0 k, 1 v, 2 q); sequences start at different offsets */
static float syn_at(const kvq_synth *syn, int w, int l, int h, int t, int d)
{
    int heads = w == 2 ? HQ : H;
    const float *base = w == 0 ? syn->k : w == 1 ? syn->v : syn->q;
    return base[(((size_t)l * heads + h) * TOK + (size_t)(t % TOK)) * D + d];
}

static void fill_row(uint16_t *row, const kvq_synth *syn, int l, int t)
{
    for (int h = 0; h < HQ; h++)
        for (int d = 0; d < D; d++) row[h * D + d] = kvq_f16_from_f32(syn_at(syn, 2, l, h, t, d));
    for (int w = 0; w < 2; w++)
        for (int h = 0; h < H; h++)
            for (int d = 0; d < D; d++) row[(HQ + w * H + h) * D + d] = kvq_f16_from_f32(syn_at(syn, w, l, h, t, d));
}

static kvq_dev_tensor view(void *base, int head0)
{
    kvq_dev_tensor t = {(uint16_t *)base + (size_t)head0 * D, KVQ_F16, ROW * D, D};
    return t;
}

/* Prefills every layer of seqs with prompts of len[i] tokens (sequence i's tokens start at i % 7). */
static int prefill(kvq_engine *e, kvq_seq **seqs, const int *len, int B, const kvq_synth *syn)
{
    int ok = 1;
    for (int l = 0; l < LAYERS && ok; l++) {
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
                            hb[3 * i + w][((size_t)h * T + t) * D + d] = kvq_f16_from_f32(syn_at(syn, w, l, h, t + i % 7, d));
            }
            it[i] = (kvq_prefill_item){seqs[i], T, hb[3 * i], hb[3 * i + 1], hb[3 * i + 2]};
        }
        ok = kvq_prefill(e, l, it, B) == KVQ_OK;
        for (int x = 0; x < 3 * B; x++) kvq_free(hb[x]);
        kvq_free(hb), kvq_free(it);
    }
    return ok;
}

/* What the failure checks compare: every layer's length and cache of every sequence. */
typedef struct {
    int n[LAYERS];
    float *k[LAYERS], *v[LAYERS];
} seq_state;

static int state_get(kvq_engine *e, kvq_seq *s, int cap, seq_state *o)
{
    int ok = 1;
    for (int l = 0; l < LAYERS; l++) {
        o->k[l] = kvq_calloc((size_t)H * cap * D, 4), o->v[l] = kvq_calloc((size_t)H * cap * D, 4);
        ok &= kvq_seq_read_cache(e, s, l, o->k[l], o->v[l], cap, &o->n[l]) == KVQ_OK;
    }
    return ok;
}

static int state_same(const seq_state *a, const seq_state *b, int cap)
{
    int same = 1;
    for (int l = 0; l < LAYERS; l++)
        same &= a->n[l] == b->n[l] && !memcmp(a->k[l], b->k[l], (size_t)H * cap * D * 4) &&
                !memcmp(a->v[l], b->v[l], (size_t)H * cap * D * 4);
    return same;
}

static void state_free(seq_state *o)
{
    for (int l = 0; l < LAYERS; l++) kvq_free(o->k[l]), kvq_free(o->v[l]);
}

static int n_refused, n_replayed, n_policy, n_cases;

/* The scheme's policies: 1 an OTT pool, 2 layers forced sparse, 4 layers TailorKV's calibration decides, 8
 * ZipCache's saliency classes (0: none) */
static int policy_of(const kvq_scheme *s)
{
    int p = 0;
    for (int l = 0; l < LAYERS; l++) {
        const kvq_layer_cfg *lc = kvq_scheme_layer(s, l);
        if (lc->mode != KVQ_MODE_SPARSE && lc->quant.outliers.keep > 0) p |= 1;
        if (lc->mode == KVQ_MODE_SPARSE) p |= 2;
        if (lc->mode == KVQ_MODE_AUTO) p |= 4;
        if (lc->mode != KVQ_MODE_SPARSE && lc->quant.saliency.metric != KVQ_SAL_NONE) p |= 8;
    }
    return p;
}

/* TailorKV (specs/tailorkv*.kvq's quantized and sparse configurations) with layers 1 and 2 forced sparse: the
 * calibration of the synthetic layers decides sparse for the specs' short prompts (100 and 24-163 tokens, fewer
 * candidates than the top 128), and this one's prompts of 228-240 tokens leave 164-176 candidates. */
static const char tk_sparse[] =
    "scheme tk_sparse {\n"
    "  classify dense_preference { queries 32; top 5%; tau 0.2; }\n"
    "  when quantize { key { bits 2; per channel; group 64; } value { bits 2; per token; group 64; } residual 128; }\n"
    "  when sparse { host_offload; sinks 8; recent 56; topk 128; critical_channels 8; }\n"
    "  layers 1..2 { mode sparse; }\n"
    "}\n";

/* ZipCache compressing every 6 decoded tokens behind a residual of 2 (specs/zipcache.kvq compresses every 100:
 * its steps here are probe steps only), so that the steps cross compressions with the probe rows of each cycle. */
static const char zip_fast[] =
    "scheme zip_fast {\n"
    "  key   { per channel; group all; }\n"
    "  value { per token; channel_separable; group hidden; }\n"
    "  residual 2;\n"
    "  saliency normalized { probes recent 20% random 20%; salient 60% bits 4; rest bits 2; every 6; }\n"
    "}\n";

/* ZipCache without a window (each token its own compression, its class decided on the host): refused by the plan. */
static const char zip_nowin[] =
    "scheme zip_nowin {\n"
    "  key   { per channel; group all; }\n"
    "  value { per token; channel_separable; group hidden; }\n"
    "  saliency normalized { probes recent 20% random 20%; salient 60% bits 4; rest bits 2; every 1; }\n"
    "}\n";

/* Prompt lengths, each event inside the emulator's 16 steps (STEPS_EMU): OTT (window of R = 32 plus G = 128; a
 * prefill of T quantizes 128 when 160 <= T < 288): competitions in the prefill and at steps 4, 9, 14; TailorKV's
 * forced sparse layers (sinks 8 + recent 56, top 128; KIVI keys flushed at R = 128): every step retrieves the top
 * 128 of 172-186 candidates, the quantized layer flushes at steps 6, 12 (and 20, beyond the steps); otherwise 120
 * (crossing R = 128 at step 8) and 24-163. */
static int prompt_len(const kvq_scheme *s, int i)
{
    static const int ott[3] = {284, 279, 274}, tk[3] = {250, 244, 236};
    int p = policy_of(s);
    if (p & 1) return ott[i % 3];
    if (p & 2) return tk[i % 3];
    return i == 0 ? 120 : 24 + (i * 37 + 11) % 140; /* 120 crosses R = 128 during the steps */
}

/* ---- the sequences' device tile lists (cu_step_tiles.c) ---- */

#define PATCH_TILES 16 /* tiles a plan may send per sequence and layer, whatever the context */

/* Tiles of every layer's list of the batch, as the host mirrors hold them. */
static long list_tiles(kvq_seq **s, int B)
{
    long n = 0;
    for (int i = 0; i < B; i++)
        for (int l = 0; s[i]->bseq->tl.layer && l < LAYERS; l++) n += s[i]->bseq->tl.layer[l].n;
    return n;
}

/* After a step's runs: each sequence's device list of each layer holds exactly the tiles cu_qlayer_tiles (or
 * cu_slayer_tiles) builds from the layer now (what the host-pointer path uploads), and its host mirror says the same. Returns the lists
 * that differ. */
static int lists_differ(kvq_engine *e, kvq_seq **s, int B)
{
    kvq_backend_ctx *c = e->ctx;
    int bad = 0;
    for (int i = 0; i < B; i++)
        for (int l = 0; l < LAYERS; l++) {
            const cu_seq_tl *t = &s[i]->bseq->tl;
            const cu_layer *L = s[i]->bseq->layers[l];
            if (!t->layer || !t->layer[l].valid) {
                bad++;
                continue;
            }
            const cu_tl *T = &t->layer[l];
            /* a ZipCache layer that compressed in this step (its window back to its residual) attended before the
             * compression, as decode_run does: its list is the one the step read, so only device and mirror agree */
            int compressed = !L->sparse && L->q.saliency && L->q.win[0].count == L->q.rule[0].keep;
            int nt = 0;
            if (compressed)
                nt = T->n;
            else if (L->sparse)
                cu_slayer_tiles(c, &L->s, &nt);
            else
                cu_qlayer_tiles(c, &L->q, &nt);
            size_t bytes = (size_t)(nt > 0 ? nt : 1) * sizeof(kvq_tile);
            kvq_tile *dv = kvq_malloc(bytes);
            uint64_t at = t->addr + (uint64_t)l * t->cap * sizeof(kvq_tile);
            size_t nb = (size_t)(nt > 0 ? nt : 0) * sizeof *dv;
            const kvq_tile *want = compressed ? T->mirror : c->htiles;
            bad += !(nt >= 0 && dv && T->n == nt && dev_copy(e, dv, (void *)(uintptr_t)at, nb, 0) &&
                     !memcmp(dv, want, nb) && !memcmp(T->mirror, want, nb));
            kvq_free(dv);
        }
    return bad;
}

/* Each plan's upload of run_case: h2d bytes of the plan, and at step 0 the lists' tiles (all sent whole). */
static long plan_bytes[STEPS], plan_tiles0;

static void note_plan(int st, kvq_seq **s, int B, const cu_dev_counters *before)
{
    cu_dev_counters now;
    cu_dev_counters_get(&now);
    plan_bytes[st] = now.h2d_bytes - before->h2d_bytes;
    if (st == 0) plan_tiles0 = list_tiles(s, B);
}

/* A plan's one upload is the fixed tables (step 0's bytes less its lists, which a sequence's first plan sends
 * whole) and the tiles that changed: at most PATCH_TILES per sequence and layer at every step, whatever the
 * context, so the bytes at the last step are those at step 10 within that bound. Returns the largest tile part. */
static long check_plan_bytes(int B, int n_steps, long lists_now)
{
    long fixed = plan_bytes[0] - plan_tiles0 * (long)sizeof(kvq_tile), worst = 0,
         bound = (long)B * LAYERS * PATCH_TILES * (long)sizeof(kvq_tile);
    for (int st = 1; st < n_steps && !th_failed(); st++) {
        long p = plan_bytes[st] - fixed;
        TH_CHECK(p >= 0 && p % (long)sizeof(kvq_tile) == 0 && p <= bound,
                 "step %d: the plan sent %ld bytes of tiles (bound %ld)", st, p, bound);
        if (p > worst) worst = p;
    }
    TH_CHECK(n_steps <= 10 || labs(plan_bytes[n_steps - 1] - plan_bytes[10]) <= bound,
             "the upload grew from %ld bytes at step 10 to %ld at step %d", plan_bytes[10], plan_bytes[n_steps - 1],
             n_steps - 1);
    printf("  plan upload: %ld bytes of tables + at most %ld of tiles a step (%ld tiles, %ld bytes, in the lists)\n",
           fixed, worst, lists_now, lists_now * (long)sizeof(kvq_tile));
    return worst;
}

/* Engine A (host pointers) against engine B (plan + graph replay) for one spec and batch. */
static void run_case(const char *file, const kvq_scheme *s, const kvq_synth *syn, int B)
{
    const kvq_layer_cfg *lc0 = kvq_scheme_layer(s, 0);
    const int zip = (policy_of(s) & 8) && lc0->quant.residual > 0; /* compressions every few steps: zip_fast */
    const int steps = ON_GPU ? STEPS : B > 3 ? STEPS_WIDE : zip ? STEPS_ZIP : STEPS_EMU; /* a GPU takes them all */
    n_cases++;
    sanitized_kernels(B == 1);
    th_begin("replay: %s (%s), batch %d: a step planned and captured once, then %d steps of plan + graph replay, "
             "equal to the host path bit for bit with no sync, alloc, D2H or host launch in a replayed step",
             kvq_scheme_name(s), file, B, steps - 2);
    char err[1024];
    kvq_engine *ea = engine_for(s, err, sizeof err), *eb = ea ? engine_for(s, err, sizeof err) : NULL;
    TH_CHECK(ea && eb, "engines: %s", err);
    kvq_seq **sa = kvq_calloc((size_t)B, sizeof *sa), **sb = kvq_calloc((size_t)B, sizeof *sb);
    int *len = kvq_calloc((size_t)B, sizeof *len), maxlen = 0;
    for (int i = 0; i < B; i++) {
        len[i] = prompt_len(s, i);
        if (len[i] + steps > maxlen) maxlen = len[i] + steps;
    }
    for (int i = 0; i < B && !th_failed(); i++)
        TH_CHECK(kvq_seq_create(ea, &sa[i]) == KVQ_OK && kvq_seq_create(eb, &sb[i]) == KVQ_OK, "seq");
    TH_CHECK(th_failed() || (prefill(ea, sa, len, B, syn) && prefill(eb, sb, len, B, syn)), "prefill: %s / %s",
             kvq_engine_errmsg(ea), kvq_engine_errmsg(eb));
    TH_CHECK(th_failed() || kvq_engine_reserve_device(eb, (size_t)64 << 20) == KVQ_OK, "reserve_device: %s",
             kvq_engine_errmsg(eb));
    TH_CHECK(th_failed() || kvq_engine_reserve_step(eb, B, maxlen) == KVQ_OK, "reserve_step: %s",
             kvq_engine_errmsg(eb));
    /* device buffers of each layer: fused q|k|v rows in, fp32 outputs */
    uint16_t *din[LAYERS] = {0};
    float *dout[LAYERS] = {0};
    for (int l = 0; l < LAYERS && !th_failed(); l++) {
        din[l] = dev_alloc(eb, (size_t)B * ROW * D * 2);
        dout[l] = dev_alloc(eb, (size_t)B * HQ * D * 4);
        TH_CHECK(din[l] && dout[l], "device buffers");
    }
    kvq_dev_decode dd[LAYERS];
    for (int l = 0; l < LAYERS; l++)
        dd[l] = (kvq_dev_decode){sb, B, view(din[l], 0), view(din[l], HQ), view(din[l], HQ + H),
                                 {dout[l], KVQ_F32, (long long)HQ * D, D}, NULL, NULL};
    float *hout = kvq_malloc((size_t)B * HQ * D * 4), *bout = kvq_malloc((size_t)B * HQ * D * 4);
    uint16_t *hin = kvq_malloc((size_t)B * ROW * D * 2);
    kvq_decode_item *di = kvq_calloc((size_t)B, sizeof *di);
    long mismatches = 0, flushes = 0, pool_changes = 0, lists_bad = 0;
    cu_dev_counters worst;
    memset(&worst, 0, sizeof worst);
    int refused = 0;
    for (int st = 0; st < steps && !th_failed() && !refused; st++) {
        uint64_t resid0 = 0, body0 = 0;
        kvq_mem_stats ms0;
        if (kvq_engine_stats(eb, &ms0) == KVQ_OK)
            resid0 = ms0.tokens[KVQ_SEG_RESIDUAL], body0 = ms0.tokens[KVQ_SEG_OUTLIER] + ms0.tokens[KVQ_SEG_SPILL];
        for (int l = 0; l < LAYERS && !th_failed(); l++) {
            for (int i = 0; i < B; i++) fill_row(hin + (size_t)i * ROW * D, syn, l, len[i] + st + i % 7);
            TH_CHECK(dev_copy(eb, din[l], hin, (size_t)B * ROW * D * 2, 1), "inputs");
        }
        cu_dev_counters c0, c1, x;
        cu_dev_counters_get(&c0);
        kvq_status ps = kvq_decode_plan(eb, sb, B, NULL);
        if (ps == KVQ_OK) note_plan(st, sb, B, &c0);
        if (ps == KVQ_ERR_UNSUPPORTED) {
            const char *m = kvq_engine_errmsg(eb);
            TH_CHECK(st == 0 && strstr(m, "ZipCache") && strstr(m, "without a window") &&
                         strstr(m, "kvq_decode_device"),
                     "the refusal names the policy and the per-step path: %s", m);
            printf("  refused (as it should be): %s\n", m);
            refused = 1;
            n_refused++;
            break;
        }
        TH_CHECK(ps == KVQ_OK, "step %d: plan: %s", st, kvq_engine_errmsg(eb));
        /* step 0 runs eagerly (warm-up: every kernel looked up), step 1 is captured (and runs), then replays */
        if (st <= 1) {
            TH_CHECK(st == 0 || graph_begin(eb), "begin capture");
            for (int l = 0; l < LAYERS && !th_failed(); l++)
                TH_CHECK(kvq_decode_run(eb, l, &dd[l]) == KVQ_OK, "step %d: layer %d: %s", st, l,
                         kvq_engine_errmsg(eb));
            TH_CHECK(st == 0 || graph_end(eb), "end capture: nothing recorded");
        }
        if (st == 1 && ON_GPU) TH_CHECK(graph_launch(eb, err, sizeof err), "%s", err); /* a GPU graph runs now */
        if (st >= 2) TH_CHECK(graph_launch(eb, err, sizeof err), "step %d: replay: %s", st, err);
        cu_dev_counters_get(&c1);
        cu_dev_counters_diff(&c1, &c0, &x);
        if (st == 1)
            TH_CHECK(x.capture_refused == 0 && x.syncs == 0 && x.allocs == 0 && x.d2h == 0 && x.h2d == 1,
                     "captured step: refused %ld syncs %ld allocs %ld d2h %ld h2d %ld", x.capture_refused, x.syncs,
                     x.allocs, x.d2h, x.h2d);
        else if (st >= 2)
            TH_CHECK(x.syncs == 0 && x.allocs == 0 && x.frees == 0 && x.host_allocs == 0 && x.d2h == 0 &&
                         x.launches == 0 && x.memsets == 0 && x.loads == 0 && x.h2d == 1 && x.replays == !ON_GPU &&
                         (ON_GPU || x.replayed_nodes == cu_dev_graph_nodes()) && x.event_waits == 1,
                     "replayed step %d: syncs %ld allocs %ld frees %ld d2h %ld launches %ld memsets %ld h2d %ld "
                     "replays %ld nodes %ld event waits %ld",
                     st, x.syncs, x.allocs, x.frees, x.d2h, x.launches, x.memsets, x.h2d, x.replays,
                     x.replayed_nodes, x.event_waits);
        /* engine A, layer by layer, through host pointers; B's outputs must be the same bits */
        for (int l = 0; l < LAYERS && !th_failed(); l++) {
            for (int i = 0; i < B; i++) {
                uint16_t *r = hin + (size_t)i * ROW * D;
                fill_row(r, syn, l, len[i] + st + i % 7);
                di[i] = (kvq_decode_item){sa[i], r + HQ * D, r + (HQ + H) * D, r, hout + (size_t)i * HQ * D};
            }
            TH_CHECK(kvq_decode(ea, l, di, B) == KVQ_OK, "host decode: %s", kvq_engine_errmsg(ea));
            TH_CHECK(dev_copy(eb, bout, dout[l], (size_t)B * HQ * D * 4, 0), "outputs");
            for (size_t j = 0; j < (size_t)B * HQ * D && !th_failed(); j++)
                mismatches += memcmp(&hout[j], &bout[j], 4) != 0;
        }
        kvq_mem_stats ms1;
        if (kvq_engine_stats(eb, &ms1) == KVQ_OK && ms1.tokens[KVQ_SEG_RESIDUAL] < resid0) flushes++;
        if (ms1.tokens[KVQ_SEG_OUTLIER] + ms1.tokens[KVQ_SEG_SPILL] != body0) pool_changes++;
        if (!th_failed()) lists_bad += lists_differ(eb, sb, B);
    }
    if (!refused) {
        TH_CHECK(lists_bad == 0, "%ld device tile lists differ from the layers' tiles", lists_bad);
        check_plan_bytes(B, steps, list_tiles(sb, B));
        TH_CHECK(mismatches == 0, "%ld output elements differ from the host path's", mismatches);
        /* a spec with a residual window flushed it on the way (KIVI at R = 32 or 128) */
        const kvq_layer_cfg *lc = kvq_scheme_layer(s, 0);
        int pol = policy_of(s), sparse = 0, quant = 0;
        for (int l = 0; l < LAYERS; l++) {
            sparse += kvq_engine_layer_state(eb, l) == KVQ_LAYER_SPARSE;
            quant += kvq_engine_layer_state(eb, l) == KVQ_LAYER_QUANTIZED;
        }
        TH_CHECK(lc->quant.residual == 0 || flushes > 0 || (sparse > 0 && !(pol & 2)), "no flush happened during the "
                 "steps (%d quantized layers)", quant);
        /* OTT: the pool layer's competitions during the steps changed the pools (spill 32: evicted members spill) */
        int spill = 0; /* without a spill pool an eviction unmasks the body slot: the counts need not change */
        for (int l = 0; l < LAYERS; l++) spill += kvq_scheme_layer(s, l)->quant.outliers.spill;
        /* ...and each sequence's competition came during the steps (prompt_len), so that a pool-state copy flips
         * while the other sequences' items are empty */
        TH_CHECK(!(pol & 1) || pool_changes >= (B < 3 ? B : 3) || spill == 0,
                 "%ld steps changed the outlier pools, fewer than the batch's %d competitions", pool_changes,
                 B < 3 ? B : 3);
        /* TailorKV: the steps ran through sparse layers (every step retrieves) */
        TH_CHECK(!(pol & 2) || sparse > 0, "no layer is sparse");
        /* ZipCache with a residual window (zip_fast): compressions during the steps (counted with the flushes) */
        TH_CHECK(!(pol & 8) || lc->quant.residual == 0 || flushes >= 5, "%ld compressions", flushes);
        if (pol) printf("  %s: %ld flushes or compressions, %ld steps changed the pools, %d sparse layers\n",
                        kvq_scheme_name(s), flushes, pool_changes, sparse);
        n_policy += pol != 0;
        for (int l = 0; l < LAYERS && !th_failed(); l++)
            for (int i = 0; i < B; i++) {
                int cap = len[i] + steps, n1 = 0, n2 = 0;
                size_t sz = (size_t)H * cap * D;
                float *k1 = kvq_calloc(sz, 4), *v1 = kvq_calloc(sz, 4), *k2 = kvq_calloc(sz, 4),
                      *v2 = kvq_calloc(sz, 4);
                TH_CHECK(kvq_seq_read_cache(ea, sa[i], l, k1, v1, cap, &n1) == KVQ_OK &&
                             kvq_seq_read_cache(eb, sb[i], l, k2, v2, cap, &n2) == KVQ_OK,
                         "read_cache");
                TH_CHECK(n1 == cap && n2 == cap && !memcmp(k1, k2, sz * 4) && !memcmp(v1, v2, sz * 4),
                         "layer %d sequence %d: caches differ (%d / %d tokens)", l, i, n1, n2);
                kvq_free(k1), kvq_free(v1), kvq_free(k2), kvq_free(v2);
            }
        kvq_mem_stats a, b;
        TH_CHECK(th_failed() || (kvq_engine_stats(ea, &a) == KVQ_OK && kvq_engine_stats(eb, &b) == KVQ_OK &&
                                 !memcmp(&a, &b, sizeof a)),
                 "statistics differ");
        n_replayed++;
    }
    graph_free(eb);
    for (int l = 0; l < LAYERS && eb; l++) dev_free(eb, din[l]), dev_free(eb, dout[l]);
    kvq_free(hout), kvq_free(bout), kvq_free(hin), kvq_free(di);
    kvq_free(sa), kvq_free(sb), kvq_free(len);
    kvq_engine_free(ea);
    kvq_engine_free(eb);
    th_end();
}

/* Capacity refusals and a plan failed at every allocation and at its device copy, step after step; each refusal
 * or failure leaves every layer of every sequence as it was, and the steps then continue equal to engine A's. */
static void test_failures(const kvq_scheme *s, const kvq_synth *syn, const int *lens, int NSTEPS, const char *what)
{
    enum { B = 3 };
    sanitized_kernels(2);
    th_begin("replay: %s: plans beyond the capacity are refused, plans failed at each allocation and at the device "
             "copy leave every layer as it was, over %d steps crossing %s",
             kvq_scheme_name(s), NSTEPS, what);
    char err[1024];
    kvq_engine *ea = engine_for(s, err, sizeof err), *eb = ea ? engine_for(s, err, sizeof err) : NULL;
    TH_CHECK(ea && eb, "engines: %s", err);
    kvq_seq *sa[B] = {0}, *sb[B] = {0};
    int len[B] = {lens[0], lens[1], lens[2]}, maxl = 0;
    for (int i = 0; i < B; i++) maxl = len[i] > maxl ? len[i] : maxl;
    int cap = maxl + NSTEPS + 1;
    for (int i = 0; i < B && !th_failed(); i++)
        TH_CHECK(kvq_seq_create(ea, &sa[i]) == KVQ_OK && kvq_seq_create(eb, &sb[i]) == KVQ_OK, "seq");
    TH_CHECK(th_failed() || (prefill(ea, sa, len, B, syn) && prefill(eb, sb, len, B, syn)), "prefill");
    /* no reservation yet */
    TH_CHECK(th_failed() || (kvq_decode_plan(eb, sb, B, NULL) == KVQ_ERR_STATE &&
                             strstr(kvq_engine_errmsg(eb), "kvq_engine_reserve_step")),
             "plan without a reservation: %s", kvq_engine_errmsg(eb));
    TH_CHECK(th_failed() || kvq_engine_reserve_step(eb, B - 1, maxl + NSTEPS) == KVQ_OK, "reserve_step: %s",
             kvq_engine_errmsg(eb));
    TH_CHECK(th_failed() || (kvq_decode_plan(eb, sb, B, NULL) == KVQ_ERR_SHAPE &&
                             strstr(kvq_engine_errmsg(eb), "beyond the step capacity")),
             "batch beyond the capacity: %s", kvq_engine_errmsg(eb));
    TH_CHECK(th_failed() || kvq_engine_reserve_step(eb, B, maxl + NSTEPS) == KVQ_OK, "reserve_step: %s",
             kvq_engine_errmsg(eb));
    TH_CHECK(th_failed() || kvq_engine_reserve_step(eb, 0, 10) == KVQ_ERR_INVALID, "max_batch 0 accepted");
    uint16_t *din = th_failed() ? NULL : dev_alloc(eb, (size_t)B * ROW * D * 2);
    float *dout = th_failed() ? NULL : dev_alloc(eb, (size_t)B * HQ * D * 4);
    TH_CHECK(th_failed() || (din && dout), "device buffers");
    kvq_dev_decode dd = {sb, B, view(din, 0), view(din, HQ), view(din, HQ + H), {dout, KVQ_F32, HQ * D, D}, NULL, NULL};
    TH_CHECK(th_failed() || (kvq_decode_run(eb, 0, &dd) == KVQ_ERR_STATE && strstr(kvq_engine_errmsg(eb), "plan")),
             "run without a plan: %s", kvq_engine_errmsg(eb));
    float *hout = kvq_malloc((size_t)B * HQ * D * 4), *bout = kvq_malloc((size_t)B * HQ * D * 4);
    uint16_t *hin = kvq_malloc((size_t)B * ROW * D * 2);
    kvq_decode_item di[B];
    long failures = 0, mismatches = 0, lists_bad = 0;
    for (int st = 0; st <= NSTEPS && !th_failed(); st++) {
        seq_state before[B];
        for (int i = 0; i < B; i++) TH_CHECK(state_get(eb, sb[i], cap, &before[i]), "read_cache");
        /* the plan's device copy fails, then every allocation of the plan in turn */
        cu_dev_fail_after(1);
        kvq_status ps = kvq_decode_plan(eb, sb, B, NULL);
        cu_dev_fail_after(0);
        for (long k = 1; k < 1000 && !th_failed(); k++) {
            if (ps == KVQ_OK || ps == KVQ_ERR_SHAPE) break;
            failures++;
            for (int i = 0; i < B && !th_failed(); i++) {
                seq_state now;
                TH_CHECK(state_get(eb, sb[i], cap, &now) && state_same(&before[i], &now, cap),
                         "step %d: a failed plan (%s) changed sequence %d", st, kvq_engine_errmsg(eb), i);
                state_free(&now);
            }
            kvq_alloc_fail_after(k);
            ps = kvq_decode_plan(eb, sb, B, NULL);
            kvq_alloc_fail_after(0);
        }
        if (st == NSTEPS) {
            /* the longest sequence is at the reserved length: the next token is beyond it, and nothing changes */
            TH_CHECK(ps == KVQ_ERR_SHAPE && strstr(kvq_engine_errmsg(eb), "beyond the step capacity"),
                     "length beyond the capacity: %d %s", (int)ps, kvq_engine_errmsg(eb));
            for (int i = 0; i < B && !th_failed(); i++) {
                seq_state now;
                TH_CHECK(state_get(eb, sb[i], cap, &now) && state_same(&before[i], &now, cap),
                         "the refusal changed sequence %d", i);
                state_free(&now);
            }
        } else {
            TH_CHECK(ps == KVQ_OK, "step %d: plan: %s", st, kvq_engine_errmsg(eb));
        }
        for (int i = 0; i < B; i++) state_free(&before[i]);
        if (st == NSTEPS || th_failed()) break;
        /* the planned step, run eagerly layer by layer, against engine A */
        for (int l = 0; l < LAYERS && !th_failed(); l++) {
            for (int i = 0; i < B; i++) {
                uint16_t *r = hin + (size_t)i * ROW * D;
                fill_row(r, syn, l, len[i] + st + i % 7);
                di[i] = (kvq_decode_item){sa[i], r + HQ * D, r + (HQ + H) * D, r, hout + (size_t)i * HQ * D};
            }
            if (st == 0 && l == 0) { /* the run takes the planned batch only */
                kvq_dev_decode bad = dd;
                bad.n_seqs = B - 1;
                TH_CHECK(kvq_decode_run(eb, l, &bad) == KVQ_ERR_INVALID && strstr(kvq_engine_errmsg(eb), "planned"),
                         "run of another batch: %s", kvq_engine_errmsg(eb));
            }
            TH_CHECK(dev_copy(eb, din, hin, (size_t)B * ROW * D * 2, 1), "inputs");
            TH_CHECK(kvq_decode_run(eb, l, &dd) == KVQ_OK, "step %d layer %d: run: %s", st, l, kvq_engine_errmsg(eb));
            TH_CHECK(kvq_decode(ea, l, di, B) == KVQ_OK, "host decode: %s", kvq_engine_errmsg(ea));
            TH_CHECK(dev_copy(eb, bout, dout, (size_t)B * HQ * D * 4, 0), "outputs");
            for (size_t j = 0; j < (size_t)B * HQ * D; j++) mismatches += memcmp(&hout[j], &bout[j], 4) != 0;
        }
        /* the failed plans left each device tile list and its mirror as the last committed plan made them */
        if (!th_failed()) lists_bad += lists_differ(eb, sb, B);
    }
    TH_CHECK(failures > NSTEPS, "only %ld failures injected", failures);
    TH_CHECK(lists_bad == 0, "%ld device tile lists differ from the layers' tiles after failed plans", lists_bad);
    TH_CHECK(mismatches == 0, "%ld output elements differ from the host path's", mismatches);
    for (int l = 0; l < LAYERS && !th_failed(); l++)
        for (int i = 0; i < B; i++) {
            seq_state x, y;
            TH_CHECK(state_get(ea, sa[i], cap, &x) && state_get(eb, sb[i], cap, &y) && state_same(&x, &y, cap),
                     "sequence %d: caches differ from the host path's", i);
            state_free(&x), state_free(&y);
        }
    printf("  %ld failed plans, each leaving every layer as it was\n", failures);
    /* a backend without planned steps says so */
    kvq_engine_config rc;
    kvq_engine_config_init(&rc);
    rc.dims = (kvq_dims){LAYERS, HQ, H, D};
    kvq_engine *r = NULL;
    TH_CHECK(kvq_engine_create(s, &rc, &r, err, sizeof err) == KVQ_OK, "reference: %s", err);
    TH_CHECK(!r || (kvq_engine_reserve_step(r, 1, 100) == KVQ_ERR_UNSUPPORTED &&
                    strstr(kvq_engine_errmsg(r), "no planned steps")),
             "reference: %s", r ? kvq_engine_errmsg(r) : "");
    kvq_engine_free(r);
    kvq_free(hout), kvq_free(bout), kvq_free(hin);
    if (eb) dev_free(eb, din), dev_free(eb, dout);
    kvq_engine_free(ea);
    kvq_engine_free(eb);
    th_end();
}

/* ---- sequences leaving and joining, long contexts (the device tile lists) ---- */

/* One step of the batch on both engines: A through kvq_decode; B planned (mode 0: run eagerly, 1: captured, 2:
 * graph replayed) or, mode 3, through kvq_decode too (the host path between planned steps). Token tok[i] of the
 * synthetic stream is sequence i's. Returns the output elements that differ; *bytes: the plan's upload. */
static long both_step(kvq_engine *ea, kvq_engine *eb, kvq_seq **sa, kvq_seq **sb, int B, const int *tok, int mode,
                      const kvq_synth *syn, uint16_t **din, float **dout, long *bytes)
{
    char err[512];
    long bad = 0;
    float *hout = kvq_malloc((size_t)B * HQ * D * 4), *bout = kvq_malloc((size_t)B * HQ * D * 4);
    uint16_t *hin = kvq_malloc((size_t)B * ROW * D * 2);
    kvq_decode_item *di = kvq_calloc((size_t)B, sizeof *di);
    kvq_dev_decode dd[LAYERS];
    for (int l = 0; l < LAYERS && mode < 3 && !th_failed(); l++) {
        for (int i = 0; i < B; i++) fill_row(hin + (size_t)i * ROW * D, syn, l, tok[i]);
        TH_CHECK(dev_copy(eb, din[l], hin, (size_t)B * ROW * D * 2, 1), "inputs");
        dd[l] = (kvq_dev_decode){sb, B, view(din[l], 0), view(din[l], HQ), view(din[l], HQ + H),
                                 {dout[l], KVQ_F32, (long long)HQ * D, D}, NULL, NULL};
    }
    *bytes = 0;
    if (mode < 3 && !th_failed()) {
        cu_dev_counters c0, c1;
        cu_dev_counters_get(&c0);
        TH_CHECK(kvq_decode_plan(eb, sb, B, NULL) == KVQ_OK, "plan: %s", kvq_engine_errmsg(eb));
        cu_dev_counters_get(&c1);
        *bytes = c1.h2d_bytes - c0.h2d_bytes;
        if (mode <= 1 && !th_failed()) {
            TH_CHECK(mode == 0 || graph_begin(eb), "begin capture");
            for (int l = 0; l < LAYERS && !th_failed(); l++)
                TH_CHECK(kvq_decode_run(eb, l, &dd[l]) == KVQ_OK, "layer %d: %s", l, kvq_engine_errmsg(eb));
            TH_CHECK(mode == 0 || graph_end(eb), "end capture");
        }
        if (!th_failed() && (mode == 2 || (mode == 1 && ON_GPU)))
            TH_CHECK(graph_launch(eb, err, sizeof err), "replay: %s", err);
    }
    for (int l = 0; l < LAYERS && !th_failed(); l++) {
        for (int i = 0; i < B; i++) {
            uint16_t *r = hin + (size_t)i * ROW * D;
            fill_row(r, syn, l, tok[i]);
            di[i] = (kvq_decode_item){sa[i], r + HQ * D, r + (HQ + H) * D, r, hout + (size_t)i * HQ * D};
        }
        TH_CHECK(kvq_decode(ea, l, di, B) == KVQ_OK, "host decode: %s", kvq_engine_errmsg(ea));
        if (mode == 3) {
            for (int i = 0; i < B; i++) di[i].seq = sb[i], di[i].out = bout + (size_t)i * HQ * D;
            TH_CHECK(kvq_decode(eb, l, di, B) == KVQ_OK, "host decode (B): %s", kvq_engine_errmsg(eb));
        } else {
            TH_CHECK(dev_copy(eb, bout, dout[l], (size_t)B * HQ * D * 4, 0), "outputs");
        }
        for (size_t j = 0; j < (size_t)B * HQ * D; j++) bad += memcmp(&hout[j], &bout[j], 4) != 0;
    }
    kvq_free(hout), kvq_free(bout), kvq_free(hin), kvq_free(di);
    return bad;
}

/* KIVI-2 (R = 128) at batch 3 with prompts of 1200 to 2000 tokens, in three phases of NS planned steps (eager,
 * captured, replayed): the first batch; then sequence 1 leaves (freed: its device lists go back to the pool) and
 * a new one of 1500 tokens joins, whose lists take those very bytes, stale, and a step goes through the host path
 * kvq_decode (which leaves the lists alone) before the new batch is planned and captured again; then the
 * capacity is reserved again for sequences twice as long (every sequence's lists made again, larger) after
 * another host-path step. Every output equals engine A's (host path) bit for bit, after every step every device
 * list is the layer's tiles and its mirror says so, the caches equal at the end. A plan sends the fixed tables,
 * the new sequences' lists whole, and at most PATCH_TILES tiles per other sequence and layer: at most half the
 * lists; and the host computes no more tiles than that either (the heads and the tails, not the lists). */
static void test_join_leave(const kvq_scheme *s, const kvq_synth *syn)
{
    enum { B = 3, NS = 8, PHASES = 3 };
    th_begin("replay: %s: long contexts, a sequence leaves and one joins, a new reservation, host-path steps between "
             "planned steps: device tile lists patched, outputs equal to the host path",
             kvq_scheme_name(s));
    sanitized_kernels(0);
    char err[1024];
    kvq_engine *ea = engine_for(s, err, sizeof err), *eb = ea ? engine_for(s, err, sizeof err) : NULL;
    TH_CHECK(ea && eb, "engines: %s", err);
    kvq_seq *sa[B + 1] = {0}, *sb[B + 1] = {0};
    int len[B + 1] = {2000, 1200, 1800, 1500}, tok[B];
    for (int i = 0; i < B + 1 && !th_failed(); i++)
        TH_CHECK(kvq_seq_create(ea, &sa[i]) == KVQ_OK && kvq_seq_create(eb, &sb[i]) == KVQ_OK, "seq");
    TH_CHECK(th_failed() || (prefill(ea, sa, len, B, syn) && prefill(eb, sb, len, B, syn)), "prefill: %s / %s",
             kvq_engine_errmsg(ea), kvq_engine_errmsg(eb));
    TH_CHECK(th_failed() || kvq_engine_reserve_device(eb, (size_t)64 << 20) == KVQ_OK, "reserve_device");
    TH_CHECK(th_failed() || kvq_engine_reserve_step(eb, B, 2000 + 2 * NS + 1) == KVQ_OK, "reserve_step: %s",
             kvq_engine_errmsg(eb));
    uint16_t *din[LAYERS] = {0};
    float *dout[LAYERS] = {0};
    for (int l = 0; l < LAYERS && !th_failed(); l++) {
        din[l] = dev_alloc(eb, (size_t)B * ROW * D * 2);
        dout[l] = dev_alloc(eb, (size_t)B * HQ * D * 4);
        TH_CHECK(din[l] && dout[l], "device buffers");
    }
    long mismatches = 0, lists_bad = 0, bytes[PHASES][NS] = {{0}}, fresh[PHASES] = {0}, worst = 0, lists = 0, built = 0;
    for (int phase = 0; phase < PHASES && !th_failed(); phase++) {
        if (phase == 1) {
            /* sequence 1 leaves, sequence 3 joins in its place and gets the lists' bytes sequence 1 had */
            uint64_t freed = sb[1]->bseq->tl.addr;
            kvq_seq_free(ea, sa[1]), kvq_seq_free(eb, sb[1]);
            sa[1] = sa[B], sb[1] = sb[B], sa[B] = sb[B] = NULL;
            TH_CHECK(prefill(ea, &sa[1], &len[B], 1, syn) && prefill(eb, &sb[1], &len[B], 1, syn), "prefill");
            len[1] = len[B];
            graph_free(eb);
            for (int i = 0; i < B; i++) tok[i] = len[i]++ + i % 7;
            long unused;
            mismatches += both_step(ea, eb, sa, sb, B, tok, 3, syn, din, dout, &unused);
            for (int i = 0; i < B; i++) tok[i] = len[i]++ + i % 7;
            mismatches += both_step(ea, eb, sa, sb, B, tok, 0, syn, din, dout, &bytes[phase][0]);
            fresh[phase] = list_tiles(&sb[1], 1);
            if (!th_failed()) lists_bad += lists_differ(eb, sb, B);
            TH_CHECK(th_failed() || sb[1]->bseq->tl.addr == freed,
                     "the new sequence's lists are not in the freed bytes (the case this phase is for)");
        }
        if (phase == 2) {
            TH_CHECK(th_failed() || kvq_engine_reserve_step(eb, B, 4096) == KVQ_OK, "reserve_step: %s",
                     kvq_engine_errmsg(eb));
            graph_free(eb);
            for (int i = 0; i < B; i++) tok[i] = len[i]++ + i % 7;
            long unused;
            mismatches += both_step(ea, eb, sa, sb, B, tok, 3, syn, din, dout, &unused);
        }
        for (int st = phase == 1; st < NS && !th_failed(); st++) {
            for (int i = 0; i < B; i++) tok[i] = len[i]++ + i % 7;
            mismatches += both_step(ea, eb, sa, sb, B, tok, st < 2 ? st : 2, syn, din, dout, &bytes[phase][st]);
            if (st == 0) fresh[phase] = list_tiles(sb, B); /* every list, sent whole */
            /* the host computed the heads and the tails only, not the lists */
            if (st > 0 && eb->ctx->step.tiles_built > built) built = eb->ctx->step.tiles_built;
            if (!th_failed()) lists_bad += lists_differ(eb, sb, B);
        }
        lists = list_tiles(sb, B) * (long)sizeof(kvq_tile);
    }
    /* the fixed tables: the first plan's bytes less its lists; then each phase's first plan sends the fresh lists
     * whole and the other sequences' patches, every later plan at most PATCH_TILES tiles per sequence and layer */
    long tsz = (long)sizeof(kvq_tile), bound = (long)B * LAYERS * PATCH_TILES * tsz;
    long fixed = bytes[0][0] - fresh[0] * tsz;
    for (int phase = 0; phase < PHASES && !th_failed(); phase++) {
        long d = bytes[phase][0] - fixed - fresh[phase] * tsz;
        TH_CHECK(phase == 1 ? d >= 0 && d <= bound - (long)LAYERS * PATCH_TILES * tsz : d == 0,
                 "phase %d: the first plan sent %ld bytes, the tables are %ld, the fresh lists %ld tiles", phase,
                 bytes[phase][0], fixed, fresh[phase]);
        for (int st = 1; st < NS && !th_failed(); st++) {
            long p = bytes[phase][st] - fixed;
            TH_CHECK(p >= 0 && p <= bound, "phase %d step %d: %ld bytes of tiles (bound %ld)", phase, st, p, bound);
            if (p > worst) worst = p;
        }
    }
    TH_CHECK(mismatches == 0, "%ld output elements differ from the host path's", mismatches);
    TH_CHECK(lists_bad == 0, "%ld device tile lists differ from the layers' tiles", lists_bad);
    /* at most half the lists (a plan that sent them whole fails): with 128-token body tiles (page runs) a list at
     * these 1.2k-2k tokens is ~25 tiles, of which the tail (the windows, in fp16 tiles of plan_tile_tokens) is ~10;
     * at 32k tokens the body is 256 tiles and the tail the same ~10 */
    TH_CHECK(th_failed() || 2 * worst <= lists, "a plan sent %ld bytes of tiles, the lists hold %ld", worst, lists);
    TH_CHECK(th_failed() || (built <= (long)B * LAYERS * PATCH_TILES && 2 * built * tsz <= lists),
             "a plan computed %ld tiles on the host, the lists hold %ld", built, lists / tsz);
    for (int l = 0; l < LAYERS && !th_failed(); l++)
        for (int i = 0; i < B; i++) {
            int cap = len[i], n1 = 0, n2 = 0;
            size_t sz = (size_t)H * cap * D;
            float *k1 = kvq_calloc(sz, 4), *v1 = kvq_calloc(sz, 4), *k2 = kvq_calloc(sz, 4), *v2 = kvq_calloc(sz, 4);
            TH_CHECK(kvq_seq_read_cache(ea, sa[i], l, k1, v1, cap, &n1) == KVQ_OK &&
                         kvq_seq_read_cache(eb, sb[i], l, k2, v2, cap, &n2) == KVQ_OK,
                     "read_cache");
            TH_CHECK(n1 == cap && n2 == cap && !memcmp(k1, k2, sz * 4) && !memcmp(v1, v2, sz * 4),
                     "layer %d sequence %d: caches differ (%d / %d tokens)", l, i, n1, n2);
            kvq_free(k1), kvq_free(v1), kvq_free(k2), kvq_free(v2);
        }
    printf("  uploads: %ld, %ld and %ld bytes at the phases' first plans (%ld, %ld, %ld tiles of fresh lists), then "
           "%ld of tables + at most %ld of tiles (%ld tiles computed); the lists hold %ld bytes\n",
           bytes[0][0], bytes[1][0], bytes[2][0], fresh[0], fresh[1], fresh[2], fixed, worst, built, lists);
    graph_free(eb);
    for (int l = 0; l < LAYERS && eb; l++) dev_free(eb, din[l]), dev_free(eb, dout[l]);
    for (int i = 0; i < B + 1; i++) {
        if (sa[i]) kvq_seq_free(ea, sa[i]);
        if (sb[i]) kvq_seq_free(eb, sb[i]);
    }
    kvq_engine_free(ea);
    kvq_engine_free(eb);
    th_end();
}

int main(void)
{
    kvq_synth_params sp = kvq_synth_params_default();
    sp.layers = LAYERS, sp.kv_heads = H, sp.heads = HQ, sp.head_dim = D, sp.tokens = TOK, sp.seed = 11;
    kvq_synth syn;
    char err[512];
    if (kvq_synth_generate(&sp, &syn, err, sizeof err) != KVQ_OK) {
        th_begin("replay: synthetic data");
        TH_CHECK(0, "synth: %s", err);
        th_end();
        return th_summary();
    }
    kvq_spec *k2 = NULL;
    if (kvq_spec_parse_file(th_path("specs/kivi2-r32.kvq"), &k2) == KVQ_OK) {
        kvq_engine *probe = engine_for(kvq_spec_scheme_at(k2, 0), err, sizeof err);
        if (!probe) {
            printf("SKIP replay: %s\n", err);
            kvq_spec_free(k2);
            kvq_synth_free(&syn);
            return 0;
        }
        kvq_engine_free(probe);
        static const int lens[3] = {61, 30, 95};
        if (th_shard_mine()) test_failures(kvq_spec_scheme_at(k2, 0), &syn, lens, 36, "flushes");
    }
    kvq_spec_free(k2);
    kvq_spec *k128 = NULL;
    if (kvq_spec_parse_file(th_path("specs/kivi2.kvq"), &k128) == KVQ_OK && th_shard_mine())
        test_join_leave(kvq_spec_scheme_at(k128, 0), &syn);
    kvq_spec_free(k128);
    /* the policy layers' plans: OTT's competition of sequence 0 at step 4 (its prompt of 283 leaves 155 of the
     * 160 the window takes), TailorKV's retrieval at every step, ZipCache's probe rows and compressions (every 6) */
    static const struct {
        const char *file;
        int lens[3], steps;
        const char *what;
    } pf[] = {{"specs/ott.kvq", {283, 100, 60}, 7, "an OTT competition"},
              {NULL, {228, 100, 70}, 4, "TailorKV retrievals"},
              {NULL, {61, 30, 95}, 7, "ZipCache probe rows and a compression"}};
    for (size_t f = 0; f < sizeof pf / sizeof pf[0]; f++) {
        kvq_spec *ps = NULL;
        th_begin("replay: %s parses", pf[f].file ? pf[f].file : f == 1 ? "tk_sparse" : "zip_fast");
        const char *txt = f == 1 ? tk_sparse : zip_fast;
        TH_CHECK(pf[f].file ? kvq_spec_parse_file(th_path(pf[f].file), &ps) == KVQ_OK
                            : kvq_spec_parse_string("inline", txt, strlen(txt), &ps) == KVQ_OK,
                 "spec");
        th_end();
        if (ps && th_shard_mine()) test_failures(kvq_spec_scheme_at(ps, 0), &syn, pf[f].lens, pf[f].steps, pf[f].what);
        kvq_spec_free(ps);
    }
    char *names[64];
    int n = th_list_files("specs", ".kvq", names, 64);
    const int batches[] = {1, 3, 17};
    int n_batch17 = 0;
    /* Under the emulator batch 1 runs the kernels under ASan (sanitized_kernels) where no failure case above runs
     * them under ASan + UBSan: batch 3 asserts what batch 1 does, over a batch whose first sequence is batch 1's */
#define HAS_FAILURE_CASE(name) (!strcmp((name), "kivi2-r32.kvq") || !strcmp((name), "ott.kvq"))
    for (int f = 0; f < n; f++) {
        char rel[300];
        snprintf(rel, sizeof rel, "specs/%s", names[f]);
        kvq_spec *spec = NULL;
        if (kvq_spec_parse_file(th_path(rel), &spec) == KVQ_OK)
            for (int i = 0; i < kvq_spec_scheme_count(spec); i++)
                for (size_t x = 0; x < sizeof batches / sizeof batches[0]; x++)
                    if ((batches[x] < 17 || !strcmp(names[f], "kivi2.kvq")) &&
                        (batches[x] > 1 || ON_GPU || !HAS_FAILURE_CASE(names[f])) && th_shard_mine()) {
                        n_batch17 += batches[x] == 17;
                        run_case(rel, kvq_spec_scheme_at(spec, i), &syn, batches[x]);
                    }
        kvq_spec_free(spec);
        free(names[f]);
    }
    /* the other paths of the planned tables and list kernels, at batch 3: sinks; quantized keys beside fp16 values
     * (fp16 tensors keep no window: their pages take the new token's own store); a group flush (values in pages of
     * G, not appended); channel-separable values in hidden groups (the factor list, a hidden quantize list,
     * one-token pages); values quantized on arrival (no window); OTT without a spill pool (an evicted member's
     * key slot unmasked in the body: the key pages' mask addresses travel in the plan's tables), a flush every 32 */
    static const char extra[] =
        "scheme win_sinks { key { bits 2; per channel; group 32; } value { bits 2; per token; group 32; }\n"
        "  sinks 4; residual 32; flush kivi; }\n"
        "scheme fp16_values { key { bits 2; per channel; group 32; } value { bits 16; } residual 32; }\n"
        "scheme group_flush { key { bits 4; per channel; group 32; } value { bits 4; per token; group 32; }\n"
        "  residual 32; flush group; }\n"
        "scheme sep_hidden { key { bits 2; per channel; group 32; }\n"
        "  value { bits 4; per token; channel_separable; group hidden; } residual 32; flush kivi; }\n"
        "scheme no_window { key { bits 2; per channel; group 32; } value { bits 2; per token; group 32; } }\n"
        "scheme ott_unmask { key { bits 2; per channel; group 32; } value { bits 2; per token; group 32; }\n"
        "  residual 32; flush group; outliers { keep 3; by key_l1 largest; spill 0; } }\n";
    kvq_spec *xs = NULL;
    th_begin("replay: the extra schemes parse");
    TH_CHECK(kvq_spec_parse_string("extra", extra, sizeof extra - 1, &xs) == KVQ_OK && kvq_spec_scheme_count(xs) == 6,
             "extra schemes");
    th_end();
    for (int i = 0; xs && i < kvq_spec_scheme_count(xs); i++)
        if (th_shard_mine()) run_case("inline", kvq_spec_scheme_at(xs, i), &syn, 3);
    kvq_spec_free(xs);
    /* TailorKV's sparse layers retrieving from more candidates than the top k */
    kvq_spec *tks = NULL;
    th_begin("replay: tk_sparse parses");
    TH_CHECK(kvq_spec_parse_string("tk_sparse", tk_sparse, sizeof tk_sparse - 1, &tks) == KVQ_OK, "tk_sparse");
    th_end();
    for (int b = ON_GPU ? 1 : 3; tks && b <= 3; b += 2) /* its failure case: batch 1's ASan coverage */
        if (th_shard_mine()) run_case("inline", kvq_spec_scheme_at(tks, 0), &syn, b);
    kvq_spec_free(tks);
    /* ZipCache's compressions during the steps */
    kvq_spec *zs = NULL;
    th_begin("replay: zip_fast parses");
    TH_CHECK(kvq_spec_parse_string("zip_fast", zip_fast, sizeof zip_fast - 1, &zs) == KVQ_OK, "zip_fast");
    th_end();
    for (int b = ON_GPU ? 1 : 3; zs && b <= 3; b += 2) /* likewise */
        if (th_shard_mine()) run_case("inline", kvq_spec_scheme_at(zs, 0), &syn, b);
    kvq_spec_free(zs);
    /* what the plan still refuses: ZipCache without a window */
    zs = NULL;
    th_begin("replay: zip_nowin parses");
    TH_CHECK(kvq_spec_parse_string("zip_nowin", zip_nowin, sizeof zip_nowin - 1, &zs) == KVQ_OK, "zip_nowin");
    th_end();
    int refusal_mine = th_shard_mine();
    if (zs && refusal_mine) run_case("inline", kvq_spec_scheme_at(zs, 0), &syn, 1);
    kvq_spec_free(zs);
    th_begin("replay: every spec replayed (OTT, TailorKV and ZipCache included), ZipCache without a window refused");
    /* the specs at batches 1 and 3 (under the emulator kivi2-r32 and OTT at 3 only), KIVI-2 at 17, the extra
     * schemes, tk_sparse and zip_fast at 1 and 3 (the emulator: 3); with policies: OTT, TailorKV 1 and 2, ZipCache,
     * tk_sparse and zip_fast at each batch, and ott_unmask */
    const int min_replayed = ON_GPU ? 8 * 2 + 1 + 6 + 2 + 2 : 8 * 2 - 2 + 1 + 6 + 1 + 1,
              min_policy = ON_GPU ? 6 * 2 + 1 : 6 * 2 - 3 + 1;
    if (th_shard_count() == 1)
        TH_CHECK(n_replayed >= min_replayed && n_policy >= min_policy && n_refused == 1 && n_batch17 == 1,
                 "%d cases replayed (%d with policies), %d refused, %d at batch 17", n_replayed, n_policy, n_refused,
                 n_batch17);
    else /* a shard: every case it ran replayed, but the refusal, when it is this shard's */
        TH_CHECK(n_replayed + n_refused == n_cases && n_refused == refusal_mine, "shard: %d of %d cases replayed, %d refused",
                 n_replayed, n_cases, n_refused);
    th_end();
    kvq_synth_free(&syn);
    return th_summary();
}
