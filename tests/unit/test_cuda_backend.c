/* The emu backend (the cuda backend's code on the emulator device) against the reference backend through the
 * public API, one scheme per policy: a batch of sequences of different lengths prefilled and decoded on structured
 * K/V, with lengths chosen so that the steps cross KIVI key flushes, per-token value flushes, OTT pool
 * competitions (spill pool, and evictions back to the body), ZipCache compressions (normalized and accumulated
 * saliency) and TailorKV retrieval, every policy decision made by the policy kernels. Every decode output within
 * 1e-3 of the reference's (relative to the head's magnitude), every read_cache bit-identical (same classes, pooled
 * tokens and codes, same parameters, same fp16 rows), memory statistics identical (pool counts included); auto
 * layers' calibration scores bit-identical and their modes the same; the layers TailorKV made sparse are counted
 * so a case that never retrieves is visible. Without the emulator: "skipped: <reason>", exit 0. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "alloc.h"
#include "harness.h"
#include "kvq.h"
#include "synth.h"
#include "cu_warm.h"
#include "test_engine_util.h"

typedef struct {
    const char *file, *scheme;
    int heads, kv_heads;
    const char *text; /* a spec given inline instead of a file */
} be_case;

/* TailorKV with layers 1 and 2 forced sparse (calibration keeps the synthetic layers quantized). */
static const char tk_sparse[] =
    "scheme tk_sparse {\n"
    "  classify dense_preference { queries 32; top 5%; tau 0.2; }\n"
    "  when quantize { key { bits 2; per channel; group 64; } value { bits 2; per token; group 64; } residual 128; }\n"
    "  when sparse { host_offload; sinks 8; recent 56; topk 40; critical_channels 8; }\n"
    "  layers 1..2 { mode sparse; }\n"
    "}\n";

/* ZipCache compressing every 6 decoded tokens behind a residual of 2, so that the steps cross compressions with
 * probe rows (specs/zipcache.kvq compresses every 100). */
static const char zip_fast[] =
    "scheme zip_fast {\n"
    "  key   { per channel; group all; }\n"
    "  value { per token; channel_separable; group hidden; }\n"
    "  residual 2;\n"
    "  saliency normalized { probes recent 20% random 20%; salient 60% bits 4; rest bits 2; every 6; }\n"
    "}\n";

/* ZipCache's accumulated metric (Eq. 7) on MHA. */
static const char zip_acc[] =
    "scheme zip_acc {\n"
    "  key   { per channel; group all; }\n"
    "  value { per token; channel_separable; group hidden; }\n"
    "  residual 2;\n"
    "  saliency accumulated { probes recent 20% random 20%; salient 60% bits 4; rest bits 2; every 6; }\n"
    "}\n";

/* OTT with the largest L1 norms as outliers and no spill pool (evicted tokens go back to the body: their key
 * slots are unmasked), pages of 8 tokens behind 4 fp16 ones, so that every sequence competes while decoding. */
static const char ott_s0[] =
    "scheme ott_s0 {\n"
    "  key   { bits 2; per channel; group 8; }\n"
    "  value { bits 2; per token;   group 64; }\n"
    "  residual 4;\n"
    "  flush group;\n"
    "  outliers { keep 3; by key_l1 largest; spill 0; }\n"
    "}\n";

static const be_case cases[] = {
    /* the kernels of every spec are checked one by one in test_cuda_emu.c; here the streaming of each policy */
    {"specs/fp16.kvq", "fp16", 4, 2, NULL},
    {"specs/kivi2.kvq", "kivi2", 4, 2, NULL},
    {"specs/kivi4.kvq", "kivi4", 4, 2, NULL},
    {"specs/ott.kvq", "ott", 4, 2, NULL},
    {"specs/tailorkv1.kvq", "tailorkv1", 4, 2, NULL},
    {"specs/paper/zipcache-appendix-a.kvq", "baseline", 4, 2, NULL},
    {NULL, "tk_sparse", 4, 2, tk_sparse},
    {NULL, "zip_fast", 4, 2, zip_fast},
    {NULL, "zip_acc", 2, 2, zip_acc},
    {NULL, "ott_s0", 4, 2, ott_s0},
    /* GQA 4: q.K and p.V on tensor cores (templates/kvq_mma.cuh) for 2- and 4-bit pages, masked keys (OTT), two
     * key precision classes with the values on the fp32 path (ZipCache), value groups of 64 (TailorKV) */
    {"specs/kivi2.kvq", "kivi2", 8, 2, NULL},
    {"specs/kivi4.kvq", "kivi4", 8, 2, NULL},
    {"specs/ott.kvq", "ott", 8, 2, NULL},
    {NULL, "zip_fast", 8, 2, zip_fast},
    {NULL, "tk_sparse", 8, 2, tk_sparse},
};
#define N_CASES ((int)(sizeof cases / sizeof cases[0]))
#define LAYERS 3
#define D 128
#define BATCH 3
/* tests/gpu/test_gpu_backend.c builds this file again for the cuda backend on a real GPU, with longer sequences
 * (steps: the first eight of each sequence are compared one by one, as here) */
#ifndef CU_TEST_BACKEND
#define CU_TEST_BACKEND KVQ_BACKEND_EMU
static const int prompt_len[BATCH] = {17, 155, 250};
#define SYNTH_TOKENS 260
#else
static const int prompt_len[BATCH] = {100, 1500, 4000};
#define SYNTH_TOKENS 4010
#endif
static const int steps[BATCH] = {3, 8, 7};

static kvq_engine *make_engine(const kvq_scheme *s, kvq_backend_kind kind, int heads, int kv_heads, char *err, size_t n)
{
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){LAYERS, heads, kv_heads, D};
    cfg.dtype = KVQ_F32;
    cfg.backend = kind;
    kvq_engine *e = NULL;
    kvq_status st = kvq_engine_create(s, &cfg, &e, err, n);
    return st == KVQ_OK ? e : NULL;
}

static void compare_out(const float *a, const float *b, int heads, const char *what, int layer, int step)
{
    for (int h = 0; h < heads; h++) {
        double rel = tu_rel_err(a + (size_t)h * D, b + (size_t)h * D, (size_t)D, 1e-3);
        TH_CHECK(rel <= 1e-3, "%s layer %d step %d head %d: error %.3g of the magnitude", what, layer, step, h, rel);
    }
}

static void run_case(const be_case *c)
{
    kvq_spec *spec = NULL;
    th_begin("emu backend: %s, %d heads / %d kv heads: decode within 1e-3, read_cache and stats identical", c->scheme,
             c->heads, c->kv_heads);
    if (c->text)
        TH_CHECK(kvq_spec_parse_string("<test>", c->text, strlen(c->text), &spec) == KVQ_OK, "inline spec");
    else
        TH_CHECK(kvq_spec_parse_file(th_path(c->file), &spec) == KVQ_OK, "%s does not parse", c->file);
    const kvq_scheme *s = kvq_spec_scheme(spec, c->scheme);
    char err[1024];
    kvq_engine *ref = s ? make_engine(s, KVQ_BACKEND_REFERENCE, c->heads, c->kv_heads, err, sizeof err) : NULL;
    kvq_engine *emu = s ? make_engine(s, CU_TEST_BACKEND, c->heads, c->kv_heads, err, sizeof err) : NULL;
    TH_CHECK(ref && emu, "engines: %s", err);
    kvq_synth_params sp = kvq_synth_params_default();
    sp.layers = LAYERS, sp.kv_heads = c->kv_heads, sp.heads = c->heads, sp.head_dim = D, sp.tokens = SYNTH_TOKENS,
    sp.seed = 11;
    kvq_synth syn;
    TH_CHECK(kvq_synth_generate(&sp, &syn, err, sizeof err) == KVQ_OK, "synth: %s", err);
    int H = c->kv_heads, Hq = c->heads;
    size_t T = (size_t)sp.tokens;
    kvq_seq *rs[BATCH] = {0}, *es[BATCH] = {0};
    for (int b = 0; b < BATCH && ref && emu; b++)
        TH_CHECK(kvq_seq_create(ref, &rs[b]) == KVQ_OK && kvq_seq_create(emu, &es[b]) == KVQ_OK, "seq create");
    float *pk = kvq_malloc(H * T * D * 4), *pv = kvq_malloc(H * T * D * 4), *pq = kvq_malloc(Hq * T * D * 4);
    for (int l = 0; l < LAYERS && !th_failed(); l++) {
        const float *K = syn.k + (size_t)l * H * T * D, *V = syn.v + (size_t)l * H * T * D;
        const float *Q = syn.q + (size_t)l * Hq * T * D;
        kvq_prefill_item ri[BATCH], ei[BATCH];
        float *bufs[BATCH][3];
        for (int b = 0; b < BATCH; b++) {
            int n = prompt_len[b];
            for (int x = 0; x < 3; x++) bufs[b][x] = kvq_malloc((size_t)(x == 2 ? Hq : H) * n * D * 4);
            for (int h = 0; h < H; h++) {
                memcpy(bufs[b][0] + (size_t)h * n * D, K + (size_t)h * T * D, (size_t)n * D * 4);
                memcpy(bufs[b][1] + (size_t)h * n * D, V + (size_t)h * T * D, (size_t)n * D * 4);
            }
            for (int h = 0; h < Hq; h++)
                memcpy(bufs[b][2] + (size_t)h * n * D, Q + (size_t)h * T * D, (size_t)n * D * 4);
            ri[b] = (kvq_prefill_item){rs[b], n, bufs[b][0], bufs[b][1], bufs[b][2]};
            ei[b] = (kvq_prefill_item){es[b], n, bufs[b][0], bufs[b][1], bufs[b][2]};
        }
        if (l == 0 && kvq_engine_layer_state(ref, 0) == KVQ_LAYER_UNDECIDED) {
            /* TailorKV calibration (Eq. 6-9) on the device: the same score as the host's, bit for bit; the other
             * layers calibrate from their first prefill (the batch's mean) and must decide the same */
            double s1 = -1, s2 = -2;
            TH_CHECK(kvq_calibrate_layer(ref, 0, prompt_len[2], bufs[2][0], bufs[2][2], &s1) == KVQ_OK &&
                         kvq_calibrate_layer(emu, 0, prompt_len[2], bufs[2][0], bufs[2][2], &s2) == KVQ_OK,
                     "calibrate: %s %s", kvq_engine_errmsg(ref), kvq_engine_errmsg(emu));
            TH_CHECK(memcmp(&s1, &s2, sizeof s1) == 0, "dense preference score %.17g, host %.17g", s2, s1);
        }
        TH_CHECK(kvq_prefill(ref, l, ri, BATCH) == KVQ_OK, "ref prefill: %s", kvq_engine_errmsg(ref));
        TH_CHECK(kvq_prefill(emu, l, ei, BATCH) == KVQ_OK, "emu prefill: %s", kvq_engine_errmsg(emu));
        for (int b = 0; b < BATCH; b++)
            for (int x = 0; x < 3; x++) kvq_free(bufs[b][x]);
        /* decode: every sequence still running steps together, as one batch */
        for (int s = 0; s < 8 && !th_failed(); s++) {
            kvq_decode_item rd[BATCH], ed[BATCH];
            float *mem[BATCH][5];
            int m = 0;
            for (int b = 0; b < BATCH; b++) {
                if (s >= steps[b]) continue;
                size_t t = (size_t)prompt_len[b] + s;
                for (int x = 0; x < 5; x++) mem[m][x] = kvq_malloc((size_t)(x < 2 ? H : Hq) * D * 4);
                for (int h = 0; h < H; h++) {
                    memcpy(mem[m][0] + h * D, K + ((size_t)h * T + t) * D, D * 4);
                    memcpy(mem[m][1] + h * D, V + ((size_t)h * T + t) * D, D * 4);
                }
                for (int h = 0; h < Hq; h++) memcpy(mem[m][2] + h * D, Q + ((size_t)h * T + t) * D, D * 4);
                rd[m] = (kvq_decode_item){rs[b], mem[m][0], mem[m][1], mem[m][2], mem[m][3]};
                ed[m] = (kvq_decode_item){es[b], mem[m][0], mem[m][1], mem[m][2], mem[m][4]};
                m++;
            }
            TH_CHECK(kvq_decode(ref, l, rd, m) == KVQ_OK, "ref decode: %s", kvq_engine_errmsg(ref));
            TH_CHECK(kvq_decode(emu, l, ed, m) == KVQ_OK, "emu decode: %s", kvq_engine_errmsg(emu));
            for (int i = 0; i < m && !th_failed(); i++) compare_out(ed[i].out, rd[i].out, Hq, c->scheme, l, s);
            for (int i = 0; i < m; i++)
                for (int x = 0; x < 5; x++) kvq_free(mem[i][x]);
        }
        /* the caches as attention sees them: bit-identical */
        for (int b = 0; b < BATCH && !th_failed(); b++) {
            int cap = prompt_len[b] + steps[b], n1 = 0, n2 = 0;
            float *k1 = kvq_malloc((size_t)H * cap * D * 4), *v1 = kvq_malloc((size_t)H * cap * D * 4);
            float *k2 = kvq_malloc((size_t)H * cap * D * 4), *v2 = kvq_malloc((size_t)H * cap * D * 4);
            TH_CHECK(kvq_seq_read_cache(ref, rs[b], l, k1, v1, cap, &n1) == KVQ_OK, "ref read");
            TH_CHECK(kvq_seq_read_cache(emu, es[b], l, k2, v2, cap, &n2) == KVQ_OK, "emu read: %s",
                     kvq_engine_errmsg(emu));
            TH_CHECK(n1 == n2 && n1 == cap, "lengths %d %d, want %d", n1, n2, cap);
            size_t bad = (size_t)-1;
            for (size_t i = 0; i < (size_t)H * cap * D && bad == (size_t)-1; i++)
                if (memcmp(&k1[i], &k2[i], 4) || memcmp(&v1[i], &v2[i], 4)) bad = i;
            TH_CHECK(bad == (size_t)-1,
                     "layer %d seq %d: cache differs at head %zu token %zu channel %zu (k %g/%g v %g/%g)", l, b,
                     bad / ((size_t)cap * D), bad / D % cap, bad % D, bad != (size_t)-1 ? k1[bad] : 0.0,
                     bad != (size_t)-1 ? k2[bad] : 0.0, bad != (size_t)-1 ? v1[bad] : 0.0,
                     bad != (size_t)-1 ? v2[bad] : 0.0);
            kvq_free(k1), kvq_free(v1), kvq_free(k2), kvq_free(v2);
        }
    }
    int sparse = 0;
    for (int l = 0; ref && l < LAYERS; l++) {
        sparse += kvq_engine_layer_state(ref, l) == KVQ_LAYER_SPARSE;
        TH_CHECK(kvq_engine_layer_state(ref, l) == kvq_engine_layer_state(emu, l), "layer %d decided differently", l);
    }
    if (sparse) printf("  %s: %d sparse layer(s)\n", c->scheme, sparse);
    kvq_mem_stats a, b;
    if (ref && emu && !th_failed()) {
        TH_CHECK(kvq_engine_stats(ref, &a) == KVQ_OK && kvq_engine_stats(emu, &b) == KVQ_OK, "stats");
        for (int g = 0; g < KVQ_SEG_COUNT; g++)
            TH_CHECK(a.bytes[g] == b.bytes[g] && a.tokens[g] == b.tokens[g],
                     "segment %s: bytes %llu/%llu tokens %llu/%llu", kvq_segment_name((kvq_segment)g),
                     (unsigned long long)a.bytes[g], (unsigned long long)b.bytes[g], (unsigned long long)a.tokens[g],
                     (unsigned long long)b.tokens[g]);
    }
    kvq_free(pk), kvq_free(pv), kvq_free(pq);
    kvq_engine_free(ref);
    kvq_engine_free(emu);
    kvq_synth_free(&syn);
    kvq_spec_free(spec);
    th_end();
}

/* TailorKV retrieval reads the prompt's keys from the channel-major host copy (cu_slayer.c): planted "needles",
 * one per step and kv head, all in the prompt's second half, each a key large on one channel only, with a value
 * far from the rest. Step s's query asks for needle s's channel, so the top-1 fetch must be that needle: a copy
 * that were stale (a part of the prompt missing), of another head or sequence, or strided wrongly, would fetch
 * another row and move the output by far more than 1e-3. Decode appends a token between steps. */
static const char tk_needle[] = "scheme tk_needle {\n"
                                "  classify dense_preference { queries 32; top 5%; tau 0.2; }\n"
                                "  when quantize { key { bits 4; per channel; group 64; } value { bits 4; per token; "
                                "group 64; } residual 128; }\n"
                                "  when sparse { host_offload; sinks 2; recent 2; topk 1; critical_channels 2; }\n"
                                "  layers 0..0 { mode sparse; }\n"
                                "}\n";

static void test_tk_needles(void)
{
    enum { NH = 4, NKV = 2, NB = 2, NSTEP = 6 };
    static const int plen[NB] = {61, 97};
    th_begin("emu backend: TailorKV top-1 retrieval finds a needle per step in the channel-major host keys");
    kvq_spec *spec = NULL;
    char err[1024] = "";
    TH_CHECK(kvq_spec_parse_string("<test>", tk_needle, strlen(tk_needle), &spec) == KVQ_OK, "spec");
    const kvq_scheme *sch = spec ? kvq_spec_scheme(spec, "tk_needle") : NULL;
    kvq_engine *e[2] = {NULL, NULL};
    for (int w = 0; w < 2 && sch; w++) {
        kvq_engine_config cfg;
        kvq_engine_config_init(&cfg);
        cfg.dims = (kvq_dims){1, NH, NKV, D};
        cfg.dtype = KVQ_F32;
        cfg.backend = w ? CU_TEST_BACKEND : KVQ_BACKEND_REFERENCE;
        TH_CHECK(kvq_engine_create(sch, &cfg, &e[w], err, sizeof err) == KVQ_OK, "engine: %s", err);
    }
    kvq_seq *sq[2][NB] = {{0}};
    for (int w = 0; w < 2 && e[1]; w++)
        for (int b = 0; b < NB; b++) TH_CHECK(kvq_seq_create(e[w], &sq[w][b]) == KVQ_OK, "seq");
    unsigned rng = 7;
    float *k[NB], *v[NB], *q[NB];
    for (int b = 0; b < NB; b++) {
        int T = plen[b];
        k[b] = kvq_malloc((size_t)NKV * T * D * 4), v[b] = kvq_malloc((size_t)NKV * T * D * 4);
        q[b] = kvq_malloc((size_t)NH * T * D * 4);
        for (size_t i = 0; i < (size_t)NKV * T * D; i++) {
            rng = rng * 1103515245u + 12345u;
            k[b][i] = ((float)(rng >> 9 & 1023) - 512.0f) / 8192.0f;
            v[b][i] = ((float)(rng >> 19 & 1023) - 512.0f) / 4096.0f;
        }
        for (size_t i = 0; i < (size_t)NH * T * D; i++) q[b][i] = 0.01f;
        for (int h = 0; h < NKV; h++)
            for (int s = 0; s < NSTEP; s++) { /* needle s of head h: a candidate (not sink, not recent) */
                int t = T / 2 + (s * 5 + h * 3 + b) % (T / 2 - 3), c = (s * 13 + h * 29 + b * 7) % D;
                k[b][((size_t)h * T + t) * D + c] = 3.0f;
                for (int d = 0; d < D; d++) v[b][((size_t)h * T + t) * D + d] = 6.0f + (float)s;
            }
    }
    kvq_prefill_item it[2][NB];
    for (int w = 0; w < 2; w++)
        for (int b = 0; b < NB; b++) it[w][b] = (kvq_prefill_item){sq[w][b], plen[b], k[b], v[b], q[b]};
    for (int w = 0; w < 2 && !th_failed(); w++)
        TH_CHECK(kvq_prefill(e[w], 0, it[w], NB) == KVQ_OK, "prefill: %s", kvq_engine_errmsg(e[w]));
    TH_CHECK(th_failed() || kvq_engine_layer_state(e[1], 0) == KVQ_LAYER_SPARSE, "layer 0 is not sparse");
    float nk[NB][NKV * D], nv[NB][NKV * D], nq[NB][NH * D], out[2][NB][NH * D];
    for (int s = 0; s < NSTEP && !th_failed(); s++) {
        kvq_decode_item di[2][NB];
        for (int b = 0; b < NB; b++) {
            int T = plen[b];
            for (int i = 0; i < NKV * D; i++) nk[b][i] = k[b][i % D] * 0.5f, nv[b][i] = v[b][i % D];
            for (int hq = 0; hq < NH; hq++) {
                int h = hq / (NH / NKV), c = (s * 13 + h * 29 + b * 7) % D;
                for (int d = 0; d < D; d++) nq[b][hq * D + d] = d == c ? 4.0f : 0.01f;
            }
            (void)T;
            for (int w = 0; w < 2; w++) di[w][b] = (kvq_decode_item){sq[w][b], nk[b], nv[b], nq[b], out[w][b]};
        }
        for (int w = 0; w < 2 && !th_failed(); w++)
            TH_CHECK(kvq_decode(e[w], 0, di[w], NB) == KVQ_OK, "decode: %s", kvq_engine_errmsg(e[w]));
        for (int b = 0; b < NB && !th_failed(); b++) compare_out(out[1][b], out[0][b], NH, "tk_needle", 0, s);
        /* the needle dominates: the reference fetched it (else the test would not test the fetch) */
        for (int b = 0; b < NB && !th_failed(); b++)
            TH_CHECK(out[0][b][0] > 1.0f, "sequence %d step %d: needle not attended (%g)", b, s, out[0][b][0]);
    }
    for (int b = 0; b < NB; b++) kvq_free(k[b]), kvq_free(v[b]), kvq_free(q[b]);
    kvq_engine_free(e[0]);
    kvq_engine_free(e[1]);
    kvq_spec_free(spec);
    th_end();
}

/* A child's job: one case's engine, which compiles its kernels into the cache (a failure shows in the parent). */
static int warm_job(int i)
{
    char err[1024];
    kvq_spec *sp = NULL;
    const be_case *c = &cases[i];
    kvq_status st = c->text ? kvq_spec_parse_string("<test>", c->text, strlen(c->text), &sp)
                            : kvq_spec_parse_file(th_path(c->file), &sp);
    if (st == KVQ_OK)
        kvq_engine_free(
            make_engine(kvq_spec_scheme(sp, c->scheme), CU_TEST_BACKEND, c->heads, c->kv_heads, err, sizeof err));
    kvq_spec_free(sp);
    return 0;
}

/* Availability: an engine for a trivial scheme. */
static int probe_backend(char *err, size_t n)
{
    kvq_spec *spec = NULL;
    if (kvq_spec_parse_file(th_path("specs/fp16.kvq"), &spec) != KVQ_OK) {
        snprintf(err, n, "specs/fp16.kvq does not parse");
        return -2;
    }
    kvq_engine *probe = make_engine(kvq_spec_scheme(spec, NULL), CU_TEST_BACKEND, 4, 2, err, n);
    kvq_spec_free(spec);
    kvq_engine_free(probe);
    return probe ? 0 : -1;
}

int main(void)
{
    char err[1024];
    /* Creating an engine compiles its kernels: two processes fill the cache first, forked before this process
     * initialises the device (cu_warm.h; on a GPU, CUDA does not survive fork), each waited for 10 minutes at
     * most; then the probe here. */
    int warm_rc = 0, probe = cu_warm_then_probe(N_CASES, 2, warm_job, probe_backend, 600, &warm_rc, err, sizeof err);
    if (probe == -2) {
        th_begin("emu backend: specs parse");
        TH_CHECK(0, "%s", err);
        th_end();
        return th_summary();
    }
    if (probe != 0) {
        printf("skipped: %s\n", err);
        return 0;
    }
    if (warm_rc != 0) printf("note: filling the cache in child processes: %s\n", err);
    for (int i = 0; i < N_CASES; i++) run_case(&cases[i]);
    test_tk_needles();

    return th_summary();
}
