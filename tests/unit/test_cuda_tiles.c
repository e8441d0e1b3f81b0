/* Decode tiles (layout/tiles.h, docs/layout.md "Tiles"): the one tile rule, and the tiles the runtime really
 * produces in a decode step (rt_step_tiles on the emu backend). KIVI writes a flush of R keys as R / G
 * per-channel pages of one group; as a page run they give tiles of the plan's 128 tokens, where pages cut them to
 * 32 before. The step's outputs are compared with the reference backend on the same inputs. Without the
 * emulator: SKIP. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "kvq.h"
#include "plan.h"
#include "rt_internal.h"
#include "test_engine_util.h"
#include "tiles.h"

static void test_rule(void)
{
    th_begin("tile rule: at most the tile, what is left of both runs, a tile begun inside a run's page ends with it");
    TH_CHECK(kvq_tile_len(128, 896, 872, 0, 32) == 128, "%d", kvq_tile_len(128, 896, 872, 0, 32));
    TH_CHECK(kvq_tile_len(128, 128, 104, 768, 32) == 104, "cut by the values");
    TH_CHECK(kvq_tile_len(128, 24, 129, 872, 32) == 24, "begun at slot 8 of a page: to the page's end");
    TH_CHECK(kvq_tile_len(128, 100, 100, 20, 32) == 12, "%d", kvq_tile_len(128, 100, 100, 20, 32));
    TH_CHECK(kvq_tile_len(128, 100, 100, 20, 0) == 100, "not a page run: no page rule");
    TH_CHECK(kvq_tile_pages(128, 0, 32) == 4 && kvq_tile_pages(104, 768, 32) == 4 && kvq_tile_pages(1, 872, 32) == 1,
             "pages spanned");
    TH_CHECK(kvq_tile_pages(40, 3, 0) == 1, "a single container");
    TH_CHECK(kvq_tile_max_pages(128, 32) == 4 && kvq_tile_max_pages(128, 48) == 3 && kvq_tile_max_pages(128, 8) == 1 &&
                 kvq_tile_max_pages(128, 128) == 1 && kvq_tile_max_pages(128, 0) == 1,
             "most pages a tile spans");
    kvq_page_format f;
    kvq_tensor_cfg t;
    memset(&t, 0, sizeof t);
    t.bits = 2, t.gran = KVQ_GRAN_CHANNEL, t.group = 32, t.scale_dtype = t.zero_dtype = KVQ_DT_FP16;
    kvq_page_format_init(&f, &t, 2, 0, 8, 128, 32);
    TH_CHECK(kvq_page_run_ok(&f), "KIVI-2 key pages form runs");
    kvq_page_format_init(&f, &t, 2, 0, 8, 128, 5);
    TH_CHECK(!kvq_page_run_ok(&f), "a short last page does not");
    t.gran = KVQ_GRAN_TOKEN;
    kvq_page_format_init(&f, &t, 2, 0, 8, 128, 32);
    TH_CHECK(!kvq_page_run_ok(&f), "per-token pages do not");
    TH_CHECK(kvq_page_run_stride(12288) == 12288 && kvq_page_run_stride(12289) == 12544, "stride");
    th_end();
}

static void fill(float *x, size_t n, unsigned seed)
{
    uint64_t s = 0x9e3779b97f4a7c15ull * (seed + 1);
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        x[i] = (float)((double)(s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
    }
}

static kvq_engine *engine(const kvq_scheme *s, kvq_backend_kind kind, int heads, int kvh, char *err, size_t n)
{
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){1, heads, kvh, 128};
    cfg.dtype = KVQ_F32;
    cfg.backend = kind;
    kvq_engine *e = NULL;
    return kvq_engine_create(s, &cfg, &e, err, n) == KVQ_OK ? e : NULL;
}

/* KIVI-2 (R = 128, G = 32), a prefill of 1000 tokens, then `steps` decode steps; the tiles of the last one, as
 * "tokens/key pages". fp16 rows (the windows) take at most plan_tile_tokens(class, 1, 1) tokens: 16 at GQA 2, 32 at
 * GQA 4 (the staging is sized for 2-bit pages, docs/cuda.md "Shared memory").
 *
 * One step: keys 0..895 one flush (a page run of 28 pages), values 0..871 one page, then token 872's value in an
 * appendable page (aligned: it ends at 896), then the windows: six tiles of 128 (4 key pages each), 104 (cut by
 * the value page's end), 1 (the append page), 23 (to the key page's end, against the value window), then the
 * windows from 896 (105 tokens) in fp16 tiles.
 * 300 steps: key flushes of 4 pages at 1024, 1152, 1280; value pages [872, 896), [896, 1024), [1024, 1152),
 * [1152, 1172) of 128 (aligned to the key flushes), the windows from 1280 (keys) and 1172 (values); the last key
 * run [1152, 1280) is cut by the value page's end (20), to its page's end (12), then against the value window in
 * fp16 tiles (cut where its ring wraps, at 1259, and at the key pages' ends where a tile began inside one); then
 * the windows (20). fp16 tiles hold 16 tokens at GQA 2 and 4 alike (each stage of the load pipeline has rows for
 * 16 fp16 tokens, plan.c). */
typedef struct {
    int steps, heads;
    const char *want;
} step_case;

static const step_case step_cases[] = {
    {1, 4, " 128/4 128/4 128/4 128/4 128/4 128/4 104/4 1/1 16/1 7/1 16/1 16/1 16/1 16/1 16/1 16/1 9/1"},
    {1, 8, " 128/4 128/4 128/4 128/4 128/4 128/4 104/4 1/1 16/1 7/1 16/1 16/1 16/1 16/1 16/1 16/1 9/1"},
    {300, 4, " 128/4 128/4 128/4 128/4 128/4 128/4 104/4 24/1 128/4 128/4 20/1 12/1 16/1 16/1 16/1 16/1 11/1 16/1 5/1 16/1 4/1"},
    {300, 8, " 128/4 128/4 128/4 128/4 128/4 128/4 104/4 24/1 128/4 128/4 20/1 12/1 16/1 16/1 16/1 16/1 11/1 16/1 5/1 16/1 4/1"},
};

static void test_step(const step_case *sc)
{
    const int heads = sc->heads;
    th_begin("kivi2 on the emu backend, GQA %d, 1000 tokens + %d decode steps: the tiles the last step read are the "
             "rule's (128-token tiles over KIVI's key page runs and aligned value pages), outputs within 1e-3 of the "
             "reference", heads / 2, sc->steps);
    const int H = 2, D = 128, N = 1000, S = sc->steps;
    kvq_spec *spec = tu_spec_file("specs/kivi2.kvq");
    const kvq_scheme *s = spec ? kvq_spec_scheme(spec, "kivi2") : NULL;
    char err[512] = "";
    kvq_engine *emu = s ? engine(s, KVQ_BACKEND_EMU, heads, H, err, sizeof err) : NULL;
    if (s && !emu) { /* no emulator here: the program says why and the case is not counted */
        printf("SKIP kivi2 decode steps on the emu backend: %s\n", err);
        kvq_spec_free(spec);
        return;
    }
    kvq_engine *ref = s ? engine(s, KVQ_BACKEND_REFERENCE, heads, H, err, sizeof err) : NULL;
    TH_CHECK(emu && ref, "engines: %s", err);
    float *kp = malloc(sizeof(float) * H * N * D), *vp = malloc(sizeof(float) * H * N * D);
    float *kn = malloc(sizeof(float) * H * D), *vn = malloc(sizeof(float) * H * D), *q = malloc(sizeof(float) * heads * D);
    float *o1 = malloc(sizeof(float) * heads * D), *o2 = malloc(sizeof(float) * heads * D);
    kvq_seq *s1 = NULL, *s2 = NULL;
    if (emu && ref && kp && vp && kn && vn && q && o1 && o2) {
        fill(kp, (size_t)H * N * D, 1), fill(vp, (size_t)H * N * D, 2);
        kvq_engine *es[2] = {emu, ref};
        kvq_seq **ss[2] = {&s1, &s2};
        float *os[2] = {o1, o2};
        for (int i = 0; i < 2; i++) {
            TH_CHECK(kvq_seq_create(es[i], ss[i]) == KVQ_OK, "seq: %s", kvq_engine_errmsg(es[i]));
            kvq_prefill_item pi = {*ss[i], N, kp, vp, NULL};
            TH_CHECK(kvq_prefill(es[i], 0, &pi, 1) == KVQ_OK, "prefill: %s", kvq_engine_errmsg(es[i]));
        }
        double worst = 0;
        for (int t = 0; t < S && !th_failed(); t++) {
            fill(kn, (size_t)H * D, 10 + 3 * t), fill(vn, (size_t)H * D, 11 + 3 * t), fill(q, (size_t)heads * D, 12 + 3 * t);
            for (int i = 0; i < 2; i++) {
                kvq_decode_item di = {*ss[i], kn, vn, q, os[i]};
                TH_CHECK(kvq_decode(es[i], 0, &di, 1) == KVQ_OK, "decode: %s", kvq_engine_errmsg(es[i]));
            }
            for (int h = 0; h < heads; h++) {
                double rel = tu_rel_err(o1 + (size_t)h * D, o2 + (size_t)h * D, (size_t)D, 1e-3);
                if (rel > worst) worst = rel;
                TH_CHECK(rel <= 1e-3, "step %d head %d: error %.3g of the magnitude", t, h, rel);
            }
        }
        kvq_tile_info t[64];
        int n = 0;
        TH_CHECK(s1 && rt_step_tiles(emu, s1, 0, t, 64, &n) == KVQ_OK, "rt_step_tiles: %s", kvq_engine_errmsg(emu));
        char got[512] = "";
        int tokens = 0;
        for (int i = 0; i < n && i < 64; i++) {
            tokens += t[i].n;
            size_t l = strlen(got);
            snprintf(got + l, sizeof got - l, " %d/%d", t[i].n, t[i].k_pages);
        }
        TH_CHECK(tokens == N + S && !strcmp(got, sc->want), "%d tiles, %d tokens:\n     got%s\n    want%s", n, tokens,
                 got, sc->want);
        /* the body's tiles read quantized keys and values, the last one the two windows */
        for (int i = 0; i < n && i < 7; i++)
            TH_CHECK(t[i].k_kind == 2 && t[i].v_kind == 2, "tile %d: kinds %d/%d", i, t[i].k_kind, t[i].v_kind);
        TH_CHECK(n > 0 && t[n - 1].k_kind == 1 && t[n - 1].v_kind == 1, "last tile: kinds %d/%d", t[n - 1].k_kind,
                 t[n - 1].v_kind);
        TH_CHECK(rt_step_tiles(ref, s2, 0, t, 64, &n) == KVQ_ERR_UNSUPPORTED, "the reference has no tile lists");
        TH_CHECK(rt_step_tiles(emu, s1, 1, t, 64, &n) == KVQ_ERR_INVALID, "layer out of range");
        if (!th_failed()) printf("  tiles:%s (worst error %.2g)\n", got, worst);
    }
    kvq_engine_free(emu), kvq_engine_free(ref);
    kvq_spec_free(spec);
    free(kp), free(vp), free(kn), free(vn), free(q), free(o1), free(o2);
    th_end();
}

int main(void)
{
    test_rule();
    /* GQA 2: the fp32 q.K path; GQA 4: q.K on tensor cores */
    for (size_t i = 0; i < sizeof step_cases / sizeof step_cases[0]; i++) test_step(&step_cases[i]);
    return th_summary();
}
