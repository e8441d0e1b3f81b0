/* The decode-tile check shared by test_cpu_tiles and test_cuda_tiles (layout/tiles.h): KIVI-2 (R = 128, G = 32),
 * a prefill of 1000 tokens, then `steps` decode steps on a backend and on the reference with the same inputs;
 * every step's outputs within 1e-3 of the reference's, and the tiles kv head 0's last step read (rt_step_tiles,
 * the backend's own list) as "tokens/key pages" equal to the case's. Each program states its expected lists and
 * why, and adds its backend's own checks through `extra`. */
#ifndef TEST_STEP_TILES_H
#define TEST_STEP_TILES_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "kvq.h"
#include "rt_internal.h"
#include "test_engine_util.h"
#include "tiles.h"

typedef struct {
    int steps, heads;
    const char *want;
    int tile; /* $KVQ_DECODE_TILE for the backend's engine (cuda's plan), 0: unset */
} step_case;

static void st_fill(float *x, size_t n, unsigned seed)
{
    uint64_t s = 0x9e3779b97f4a7c15ull * (seed + 1);
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        x[i] = (float)((double)(s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
    }
}

static kvq_engine *st_engine(const kvq_scheme *s, kvq_backend_kind kind, int heads, int kvh, char *err, size_t n)
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

/* The backend's own checks on the last step's tiles t[0, n) (be and ref engines, their sequences). */
typedef void (*st_extra_fn)(kvq_engine *be, kvq_seq *sb, kvq_engine *ref, kvq_seq *sr, const kvq_tile_info *t, int n);

/* Runs case sc on backend `be` inside the case the caller began (th_begin), and ends it. A backend this build
 * cannot create prints SKIP with the reason, and the case is not counted. */
static void st_run(const step_case *sc, kvq_backend_kind be, st_extra_fn extra)
{
    const int heads = sc->heads, H = 2, D = 128, N = 1000, S = sc->steps;
    kvq_spec *spec = tu_spec_file("specs/kivi2.kvq");
    const kvq_scheme *s = spec ? kvq_spec_scheme(spec, "kivi2") : NULL;
    char err[512] = "";
    kvq_engine *e = s ? st_engine(s, be, heads, H, err, sizeof err) : NULL;
    if (s && !e) {
        printf("SKIP kivi2 decode tiles on the %s backend: %s\n", kvq_backend_name(be), err);
        kvq_spec_free(spec);
        return;
    }
    kvq_engine *ref = s ? st_engine(s, KVQ_BACKEND_REFERENCE, heads, H, err, sizeof err) : NULL;
    TH_CHECK(e && ref, "engines: %s", err);
    float *kp = malloc(sizeof(float) * H * N * D), *vp = malloc(sizeof(float) * H * N * D);
    float *kn = malloc(sizeof(float) * H * D), *vn = malloc(sizeof(float) * H * D), *q = malloc(sizeof(float) * heads * D);
    float *o1 = malloc(sizeof(float) * heads * D), *o2 = malloc(sizeof(float) * heads * D);
    kvq_seq *s1 = NULL, *s2 = NULL;
    if (e && ref && kp && vp && kn && vn && q && o1 && o2) {
        st_fill(kp, (size_t)H * N * D, 1), st_fill(vp, (size_t)H * N * D, 2);
        kvq_engine *es[2] = {e, ref};
        kvq_seq **ss[2] = {&s1, &s2};
        float *os[2] = {o1, o2};
        for (int i = 0; i < 2; i++) {
            TH_CHECK(kvq_seq_create(es[i], ss[i]) == KVQ_OK, "seq: %s", kvq_engine_errmsg(es[i]));
            kvq_prefill_item pi = {*ss[i], N, kp, vp, NULL};
            TH_CHECK(kvq_prefill(es[i], 0, &pi, 1) == KVQ_OK, "prefill: %s", kvq_engine_errmsg(es[i]));
        }
        double worst = 0;
        for (int t = 0; t < S && !th_failed(); t++) {
            st_fill(kn, (size_t)H * D, 10 + 3 * t), st_fill(vn, (size_t)H * D, 11 + 3 * t);
            st_fill(q, (size_t)heads * D, 12 + 3 * t);
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
        TH_CHECK(s1 && rt_step_tiles(e, s1, 0, t, 64, &n) == KVQ_OK, "rt_step_tiles: %s", kvq_engine_errmsg(e));
        char got[512] = "";
        int tokens = 0;
        for (int i = 0; i < n && i < 64; i++) {
            tokens += t[i].n;
            size_t l = strlen(got);
            snprintf(got + l, sizeof got - l, " %d/%d", t[i].n, t[i].k_pages);
        }
        TH_CHECK(tokens == N + S && !strcmp(got, sc->want), "%d tiles, %d tokens:\n     got%s\n    want%s", n, tokens,
                 got, sc->want);
        /* the body's tiles (tokens [0, N - R): the prefill's value page) read quantized keys and values, the last one
         * the two windows */
        for (int i = 0, t0 = 0; i < n && i < 64 && t0 < N - 128; t0 += t[i++].n)
            TH_CHECK(t[i].k_kind == 2 && t[i].v_kind == 2, "tile %d: kinds %d/%d", i, t[i].k_kind, t[i].v_kind);
        TH_CHECK(n > 0 && t[n - 1].k_kind == 1 && t[n - 1].v_kind == 1, "last tile: kinds %d/%d", t[n - 1].k_kind,
                 t[n - 1].v_kind);
        if (extra && !th_failed()) extra(e, s1, ref, s2, t, n);
        if (!th_failed()) printf("  tiles:%s (worst error %.2g)\n", got, worst);
    }
    kvq_engine_free(e), kvq_engine_free(ref);
    kvq_spec_free(spec);
    free(kp), free(vp), free(kn), free(vn), free(q), free(o1), free(o2);
    th_end();
}

#endif
