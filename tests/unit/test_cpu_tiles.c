/* The cpu backend's decode tiles (layout/tiles.h, docs/cpu.md "Spans and tiles"): the tiles a decode step really
 * cuts (rt_step_tiles on the cpu backend: the same iterator the step runs) are the plan's (128 tokens over KIVI's
 * key page runs, kvq_tile_len), where the reference storage's separate pages cut them to 32 before; the step's
 * outputs are compared with the reference backend on the same inputs. Without LLVM: SKIP. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "kvq.h"
#include "rt_internal.h"
#include "test_engine_util.h"
#include "tiles.h"

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
    cfg.threads = 1;
    kvq_engine *e = NULL;
    return kvq_engine_create(s, &cfg, &e, err, n) == KVQ_OK ? e : NULL;
}

/* KIVI-2 (R = 128, G = 32), a prefill of 1000 tokens, then `steps` decode steps; the tiles of kv head 0 after the
 * last one, as "tokens/key pages" (the cuda backend's list, test_cuda_tiles, up to its fp16 tiles, which its
 * shared memory caps at 16 or 32 rows: the cpu backend's fp16 tiles are the plan's 128 too).
 * With one thread the step runs two KV chunks past 1024 tokens; their edge falls on a tile boundary (640).
 * One step: keys 0..895 one flush (a page run of 28 pages), values 0..871 one page, token 872's value in an
 * appendable page (ending at 896), then the windows: six tiles of 128 (4 key pages each), 104 (cut by the value
 * page's end), 1 (the append page), 23 (to the key page's end, against the value window), the key window from
 * 896 (105 tokens) against the rest of the value window.
 * 300 steps: key runs [896, 1024), [1024, 1152), [1152, 1280); value pages [872, 896), [896, 1024),
 * [1024, 1152), [1152, 1172); the last key run is cut by the value page's end (20), then to its page's end (12),
 * then 96 tokens (3 pages) against the value window; then the key window (20) against the value window's rest. */
typedef struct {
    int steps, heads;
    const char *want;
} step_case;

static const step_case step_cases[] = {
    {1, 2, " 128/4 128/4 128/4 128/4 128/4 128/4 104/4 1/1 23/1 105/1"},
    {1, 8, " 128/4 128/4 128/4 128/4 128/4 128/4 104/4 1/1 23/1 105/1"},
    {300, 2, " 128/4 128/4 128/4 128/4 128/4 128/4 104/4 24/1 128/4 128/4 20/1 12/1 96/3 20/1"},
    {300, 8, " 128/4 128/4 128/4 128/4 128/4 128/4 104/4 24/1 128/4 128/4 20/1 12/1 96/3 20/1"},
};

static void test_step(const step_case *sc)
{
    const int heads = sc->heads;
    th_begin("kivi2 on the cpu backend, GQA %d, 1000 tokens + %d decode steps: the tiles a step cuts are the rule's "
             "(the plan's 128 tokens over KIVI's key page runs), outputs within 1e-3 of the reference",
             heads / 2, sc->steps);
    const int H = 2, D = 128, N = 1000, S = sc->steps;
    kvq_spec *spec = tu_spec_file("specs/kivi2.kvq");
    const kvq_scheme *s = spec ? kvq_spec_scheme(spec, "kivi2") : NULL;
    char err[512] = "";
    kvq_engine *cpu = s ? engine(s, KVQ_BACKEND_CPU, heads, H, err, sizeof err) : NULL;
    if (s && !cpu) { /* no LLVM here: the program says why and the case is not counted */
        printf("SKIP kivi2 decode tiles on the cpu backend: %s\n", err);
        kvq_spec_free(spec);
        return;
    }
    kvq_engine *ref = s ? engine(s, KVQ_BACKEND_REFERENCE, heads, H, err, sizeof err) : NULL;
    TH_CHECK(cpu && ref, "engines: %s", err);
    float *kp = malloc(sizeof(float) * H * N * D), *vp = malloc(sizeof(float) * H * N * D);
    float *kn = malloc(sizeof(float) * H * D), *vn = malloc(sizeof(float) * H * D), *q = malloc(sizeof(float) * heads * D);
    float *o1 = malloc(sizeof(float) * heads * D), *o2 = malloc(sizeof(float) * heads * D);
    kvq_seq *s1 = NULL, *s2 = NULL;
    if (cpu && ref && kp && vp && kn && vn && q && o1 && o2) {
        fill(kp, (size_t)H * N * D, 1), fill(vp, (size_t)H * N * D, 2);
        kvq_engine *es[2] = {cpu, ref};
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
        TH_CHECK(s1 && rt_step_tiles(cpu, s1, 0, t, 64, &n) == KVQ_OK, "rt_step_tiles: %s", kvq_engine_errmsg(cpu));
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
        /* every tile is the rule's: at most the plan's tile, and a tile of several key pages is at most 128 */
        for (int i = 0; i < n; i++) TH_CHECK(t[i].n <= 128 && t[i].k_pages <= kvq_tile_max_pages(128, 32), "tile %d", i);
        if (!th_failed()) printf("  tiles:%s (worst error %.2g)\n", got, worst);
    }
    kvq_engine_free(cpu), kvq_engine_free(ref);
    kvq_spec_free(spec);
    free(kp), free(vp), free(kn), free(vn), free(q), free(o1), free(o2);
    th_end();
}

int main(void)
{
    /* GQA 1: the int8 key and value paths (on a VNNI host); GQA 4: the fp32 paths */
    for (size_t i = 0; i < sizeof step_cases / sizeof step_cases[0]; i++) test_step(&step_cases[i]);
    return th_summary();
}
