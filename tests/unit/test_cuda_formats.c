/* Every scheme of specs/formats/ (element formats: llama.cpp's q8_0/q4_0/q4_1/q5_0/q5_1, fp8 e4m3/e5m2, NVFP4,
 * MXFP4, symmetric integers, codebooks) on the emu backend (the cuda backend's kernels, templates/kvq_format.cuh,
 * on the emulator device) against the reference backend through the public API: a batch of sequences of
 * different lengths prefilled and decoded on structured K/V (kvq_synth: large key channels, outlier tokens, a
 * sink, heavy hitters) with edge values planted in the prompt (values beyond e4m3's 448 and e2m1's block range,
 * exact zeros, +-0, a constant row, fp16's largest in one kv head), so that saturation and rounding ties are
 * exercised, and each kv head has its own absolute maximum. Every
 * read_cache is bit-identical (the device's codes and parameters decode to the reference's values: the codes
 * and scales are the same bits, the tensor scales from the prompt included: kvq_tensor_amax), every decode output
 * within 1e-3 of the reference's (relative to the head's magnitude; every format, codebooks included: the decode
 * kernel stages their values as fp32 rows), memory statistics identical. No scheme is skipped or refused. Set
 * KVQ_EMU_SHUFFLE to a seed to run the emulator's threads in another order. Without the emulator:
 * "skipped: <reason>", exit 0. */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "cu_warm.h"
#include "harness.h"
#include "kvq.h"
#include "scheme.h"
#include "synth.h"
#include "test_engine_util.h"

#define LAYERS 2
#define D 128
#define BATCH 3
#define MAX_CASES 64
static const int prompt_len[BATCH] = {17, 75, 140};
static const int steps[BATCH] = {3, 6, 5};
#define SYNTH_TOKENS 150

typedef struct {
    char file[256], scheme[64];
} fmt_case;
static fmt_case cases[MAX_CASES];
static int n_cases;

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* every scheme of every .kvq file in specs/formats */
static int list_cases(char *err, size_t n)
{
    DIR *d = opendir(th_path("specs/formats"));
    if (!d) {
        snprintf(err, n, "cannot open specs/formats");
        return -1;
    }
    char *names[64];
    int nn = 0;
    struct dirent *de;
    while ((de = readdir(d)) && nn < 64) {
        size_t l = strlen(de->d_name);
        if (l > 4 && !strcmp(de->d_name + l - 4, ".kvq")) names[nn++] = strdup(de->d_name);
    }
    closedir(d);
    qsort(names, (size_t)nn, sizeof *names, by_name);
    for (int i = 0; i < nn; i++) {
        char rel[256];
        snprintf(rel, sizeof rel, "specs/formats/%s", names[i]);
        kvq_spec *sp = NULL;
        if (kvq_spec_parse_file(th_path(rel), &sp) != KVQ_OK) {
            snprintf(err, n, "%s does not parse", rel);
            kvq_spec_free(sp);
            for (int j = i; j < nn; j++) free(names[j]);
            return -1;
        }
        for (int k = 0; k < kvq_spec_scheme_count(sp) && n_cases < MAX_CASES; k++) {
            snprintf(cases[n_cases].file, sizeof cases[n_cases].file, "%s", rel);
            snprintf(cases[n_cases].scheme, sizeof cases[n_cases].scheme, "%s",
                     kvq_scheme_name(kvq_spec_scheme_at(sp, k)));
            n_cases++;
        }
        kvq_spec_free(sp);
        free(names[i]);
    }
    return 0;
}

static kvq_engine *make_engine(const kvq_scheme *s, kvq_backend_kind kind, int heads, int kv_heads, char *err,
                               size_t n)
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

/* edge values planted in token rows of the prompt (K and V of every kv head): saturation of e4m3 (448) and of
 * NVFP4/MXFP4 blocks, zeros and signed zeros, a constant row, fp16's largest (kv head 0) */
static void plant_edges(float *x, int H, size_t T, int layer)
{
    for (int h = 0; h < H; h++) {
        float *r = x + (size_t)h * T * D;
        for (int c = 0; c < D; c++) {
            r[5 * D + c] = c % 3 == 0 ? 600.0f : c % 3 == 1 ? -0.0f : 0.0f; /* beyond e4m3's 448 */
            r[9 * D + c] = 1.25f;                                         /* a constant row */
            /* fp16's largest in kv head 0 only: each kv head its own absolute maximum (tensor_scale per head) */
            const float big = h == 0 ? 65504.0f : 300.0f * (float)h;
            r[12 * D + c] = c == 7 ? big : c == 40 ? -big : (float)(c % 17) * 0.03125f;
            r[30 * D + c] = (float)((c * 7 + layer) % 33 - 16) * 0.5f; /* values on half steps: rounding ties */
        }
    }
}

static void run_case(const fmt_case *c, int heads, int kv_heads)
{
    kvq_spec *spec = NULL;
    th_begin("emu formats: %s (%s), %d heads / %d kv heads: read_cache bit-identical, decode within 1e-3",
             c->scheme, c->file, heads, kv_heads);
    TH_CHECK(kvq_spec_parse_file(th_path(c->file), &spec) == KVQ_OK, "%s does not parse", c->file);
    const kvq_scheme *s = spec ? kvq_spec_scheme(spec, c->scheme) : NULL;
    char err[1024] = "";
    kvq_engine *ref = s ? make_engine(s, KVQ_BACKEND_REFERENCE, heads, kv_heads, err, sizeof err) : NULL;
    TH_CHECK(ref, "reference engine: %s", err);
    kvq_engine *emu = s ? make_engine(s, KVQ_BACKEND_EMU, heads, kv_heads, err, sizeof err) : NULL;
    TH_CHECK(emu, "emu engine: %s", err);
    const double tol = 1e-3; /* issue 20's bound, for every format */
    kvq_synth_params sp = kvq_synth_params_default();
    sp.layers = LAYERS, sp.kv_heads = kv_heads, sp.heads = heads, sp.head_dim = D, sp.tokens = SYNTH_TOKENS;
    sp.seed = 20;
    kvq_synth syn;
    memset(&syn, 0, sizeof syn);
    TH_CHECK(kvq_synth_generate(&sp, &syn, err, sizeof err) == KVQ_OK, "synth: %s", err);
    const int H = kv_heads, Hq = heads;
    const size_t T = (size_t)sp.tokens;
    kvq_seq *rs[BATCH] = {0}, *es[BATCH] = {0};
    for (int b = 0; b < BATCH && ref && emu; b++)
        TH_CHECK(kvq_seq_create(ref, &rs[b]) == KVQ_OK && kvq_seq_create(emu, &es[b]) == KVQ_OK, "seq create");
    for (int l = 0; l < LAYERS && ref && emu && !th_failed(); l++) {
        float *K = syn.k + (size_t)l * H * T * D, *V = syn.v + (size_t)l * H * T * D;
        const float *Q = syn.q + (size_t)l * Hq * T * D;
        plant_edges(K, H, T, l);
        plant_edges(V, H, T, l + 1);
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
        TH_CHECK(kvq_prefill(ref, l, ri, BATCH) == KVQ_OK, "ref prefill: %s", kvq_engine_errmsg(ref));
        TH_CHECK(kvq_prefill(emu, l, ei, BATCH) == KVQ_OK, "emu prefill: %s", kvq_engine_errmsg(emu));
        for (int b = 0; b < BATCH; b++)
            for (int x = 0; x < 3; x++) kvq_free(bufs[b][x]);
        for (int st = 0; st < 6 && !th_failed(); st++) {
            kvq_decode_item rd[BATCH], ed[BATCH];
            float *mem[BATCH][5];
            int m = 0;
            for (int b = 0; b < BATCH; b++) {
                if (st >= steps[b]) continue;
                size_t t = (size_t)prompt_len[b] + st;
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
            for (int i = 0; i < m && !th_failed(); i++)
                for (int h = 0; h < Hq; h++) {
                    double rel = tu_rel_err(ed[i].out + (size_t)h * D, rd[i].out + (size_t)h * D, (size_t)D, 1e-3);
                    TH_CHECK(rel <= tol, "layer %d step %d item %d head %d: error %.3g of the magnitude (bound %g)",
                             l, st, i, h, rel, tol);
                }
            for (int i = 0; i < m; i++)
                for (int x = 0; x < 5; x++) kvq_free(mem[i][x]);
        }
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
            TH_CHECK(bad == (size_t)-1, "layer %d seq %d: cache differs at head %zu token %zu channel %zu (k %a/%a v %a/%a)",
                     l, b, bad / ((size_t)cap * D), bad / D % cap, bad % D, bad != (size_t)-1 ? k1[bad] : 0.0,
                     bad != (size_t)-1 ? k2[bad] : 0.0, bad != (size_t)-1 ? v1[bad] : 0.0,
                     bad != (size_t)-1 ? v2[bad] : 0.0);
            kvq_free(k1), kvq_free(v1), kvq_free(k2), kvq_free(v2);
        }
    }
    kvq_mem_stats a, b;
    if (ref && emu && !th_failed()) {
        TH_CHECK(kvq_engine_stats(ref, &a) == KVQ_OK && kvq_engine_stats(emu, &b) == KVQ_OK, "stats");
        for (int g = 0; g < KVQ_SEG_COUNT; g++)
            TH_CHECK(a.bytes[g] == b.bytes[g] && a.tokens[g] == b.tokens[g], "segment %s: bytes %llu/%llu",
                     kvq_segment_name((kvq_segment)g), (unsigned long long)a.bytes[g], (unsigned long long)b.bytes[g]);
    }
    kvq_engine_free(ref);
    kvq_engine_free(emu);
    kvq_synth_free(&syn);
    kvq_spec_free(spec);
    th_end();
}

static int warm_job(int i)
{
    char err[1024];
    kvq_spec *sp = NULL;
    if (kvq_spec_parse_file(th_path(cases[i].file), &sp) == KVQ_OK)
        kvq_engine_free(make_engine(kvq_spec_scheme(sp, cases[i].scheme), KVQ_BACKEND_EMU, 4, 2, err, sizeof err));
    kvq_spec_free(sp);
    return 0;
}

static int probe_backend(char *err, size_t n)
{
    kvq_spec *spec = NULL;
    if (kvq_spec_parse_file(th_path("specs/fp16.kvq"), &spec) != KVQ_OK) {
        snprintf(err, n, "specs/fp16.kvq does not parse");
        return -2;
    }
    kvq_engine *probe = make_engine(kvq_spec_scheme(spec, NULL), KVQ_BACKEND_EMU, 4, 2, err, n);
    kvq_spec_free(spec);
    kvq_engine_free(probe);
    return probe ? 0 : -1;
}

int main(void)
{
    char err[1024];
    th_begin("emu formats: the schemes of specs/formats/");
    TH_CHECK(list_cases(err, sizeof err) == 0, "%s", err);
    TH_CHECK(n_cases >= 13, "only %d schemes found", n_cases);
    th_end();
    const char *only = getenv("KVQ_TEST_ONLY"); /* a scheme name, to rerun one case */
    for (int i = 0; only && i < n_cases; i++)
        if (!strcmp(only, cases[i].scheme)) cases[0] = cases[i], n_cases = 1;
    int warm_rc = 0, probe = cu_warm_then_probe(n_cases, 2, warm_job, probe_backend, 600, &warm_rc, err, sizeof err);
    if (probe != 0) {
        if (probe == -2) {
            th_begin("emu formats: probe");
            TH_CHECK(0, "%s", err);
            th_end();
            return th_summary();
        }
        printf("skipped: %s\n", err);
        return 0;
    }
    if (warm_rc != 0) printf("note: filling the cache in child processes: %s\n", err);
    for (int i = 0; i < n_cases; i++) run_case(&cases[i], 4, 2);
    return th_summary();
}
