/* TurboQuant on the emu backend (the cuda backend's kernels, templates/kvq_turboquant.cuh, on the emulator device)
 * against the reference backend through the public API: every scheme of specs/rotate/turboquant*.kvq (mse keys and
 * values, prod keys with their QJL term, without and with the outlier channel split), on
 * fresh random inputs in lockstep (each sequence its own outlier channels, so its own split): every decode step's
 * attention within 1e-3 (relative to the head's magnitude), the cache read back bit-identical (the device's codes
 * and norms are the reference's bits), the same statistics. Shapes: GQA 1, 4 and 8, head_dim 64, 96, 128 and 256,
 * batches of 1-3 sequences, decodes across the appendable pages' 128-token boundary; one case again under
 * KVQ_EMU_SHUFFLE with three seeds (the emulator's threads in other orders). The data's seed is printed
 * (KVQ_TEST_SEED=N reruns it). Prod values (Algorithm 2's reconstruction, which the kernels do not apply in p.V)
 * are refused with KVQ_ERR_UNSUPPORTED, naming them. Without the emulator: "skipped: <reason>", exit 0. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "harness.h"
#include "test_engine_util.h"
#include "test_lockstep.h"

#define KVH 2
/* tests/gpu/test_gpu_turboquant.c builds this file for the cuda backend (a real GPU) */
#ifndef CU_TEST_BACKEND
#define CU_TEST_BACKEND KVQ_BACKEND_EMU
#endif
#define BE (CU_TEST_BACKEND == KVQ_BACKEND_EMU ? "emu" : "cuda")

static const tu_shape shapes[] = {
    {97, 1, 1, 128, 0, 36}, {150, 2, 4, 128, 0, 4}, {17, 3, 8, 96, 0, 4}, {60, 1, 4, 64, 0, 4}, {40, 1, 1, 256, 0, 3},
};
#define N_SHAPES ((int)(sizeof shapes / sizeof shapes[0]))

static const struct {
    const char *file, *name;
} schemes[] = {
    {"specs/rotate/turboquant.kvq", "turboquant-mse3"},          {"specs/rotate/turboquant.kvq", "turboquant-k3v2"},
    {"specs/rotate/turboquant.kvq", "turboquant-k4v3"},          {"specs/rotate/turboquant-2.5bit.kvq", "turboquant-2p5"},
    {"specs/rotate/turboquant-2.5bit.kvq", "turboquant-32x3-96x2"}, {"specs/rotate/turboquant-2.5bit.kvq", "turboquant-2p5-mse"},
    {"specs/rotate/turboquant-3.5bit.kvq", "turboquant-3p5"},    {"specs/rotate/turboquant-3.5bit.kvq", "turboquant-3p5-mse"},
};
#define N_SCHEMES ((int)(sizeof schemes / sizeof schemes[0]))

/* Scheme si on `n` shapes from shape `first` (the eight schemes take one each, every shape twice or more: each
 * scheme and shape is an emulator unit of its own, the program's time); shuffle: a KVQ_EMU_SHUFFLE seed (NULL: the emulator's own order). */
static void test_scheme(int si, int first, int n, const char *shuffle, unsigned long long seed)
{
    th_begin("%s vs reference: %s (%s)%s%s, data seed %llu: every decode step within 1e-3, same cache and "
             "statistics",
             BE, schemes[si].name, schemes[si].file, shuffle ? ", KVQ_EMU_SHUFFLE=" : "", shuffle ? shuffle : "", seed);
    if (shuffle) setenv("KVQ_EMU_SHUFFLE", shuffle, 1);
    tu_rng = seed * 0x9e3779b97f4a7c15ull + 1;
    kvq_spec *f = tu_spec_file(schemes[si].file);
    const kvq_scheme *s = f ? kvq_spec_scheme(f, schemes[si].name) : NULL;
    TH_CHECK(s, "scheme");
    for (int r = 0; r < n && !th_failed(); r++) {
        const tu_shape *sh = &shapes[(first + r) % N_SHAPES];
        double w = tu_lockstep_compare(s, CU_TEST_BACKEND, sh, KVH);
        if (w == -3)
            printf("  %s at head_dim %d: refused by both (no regular channels)\n", schemes[si].name, sh->D);
        else if (w >= 0)
            printf("  %s len %d batch %d gqa %d D %d steps %d: worst relative error %.2e\n", schemes[si].name, sh->len,
                   sh->batch, sh->gqa, sh->D, sh->steps, w);
        else
            printf("  failed at len %d batch %d gqa %d D %d\n", sh->len, sh->batch, sh->gqa, sh->D);
    }
    kvq_spec_free(f);
    unsetenv("KVQ_EMU_SHUFFLE");
    th_end();
}

/* Prod values (Algorithm 2's reconstruction in p.V) are refused by the cuda kernels, naming them. */
static void test_prod_refused(void)
{
    th_begin("%s: turboquant prod values are refused with KVQ_ERR_UNSUPPORTED, naming them", BE);
    kvq_spec *f = tu_spec_text("scheme pv { value { bits 3; turboquant prod seed 2; } }\n");
    const kvq_scheme *s = f ? kvq_spec_scheme(f, "pv") : NULL;
    TH_CHECK(s, "scheme");
    kvq_engine *e = NULL;
    char err[512] = "";
    kvq_status st = s ? tu_lockstep_engine(s, CU_TEST_BACKEND, &shapes[1], KVH, &e, err, sizeof err) : KVQ_ERR_INVALID;
    TH_CHECK(st == KVQ_ERR_UNSUPPORTED && strstr(err, "TurboQuant prod values"), "%s: %s", kvq_status_str(st), err);
    kvq_engine_free(e);
    kvq_spec_free(f);
    th_end();
}

int main(void)
{
    kvq_spec *fp = tu_spec_text("scheme f { }");
    char err[512] = "";
    kvq_engine *probe = NULL;
    if (fp) tu_lockstep_engine(kvq_spec_scheme(fp, NULL), CU_TEST_BACKEND, &shapes[3], KVH, &probe, err, sizeof err);
    kvq_engine_free(probe);
    kvq_spec_free(fp);
    if (!probe) {
        printf("skipped: %s\n", err);
        return 0;
    }
    const char *env = getenv("KVQ_TEST_SEED");
    unsigned long long seed = env && *env ? strtoull(env, NULL, 10) : (unsigned long long)time(NULL);
    const char *only = getenv("KVQ_TEST_ONLY"); /* a scheme name, to rerun one case */
    for (int i = 0; i < N_SCHEMES; i++)
        if (!only || !strcmp(only, schemes[i].name))
            test_scheme(i, i, only ? N_SHAPES : 1, NULL, seed + (unsigned long long)i);
    if (only) return th_summary();
    /* the outlier split with prod keys at head_dim 64, the emulator's threads in three other orders */
    static const char *const shuffles[] = {"1", "2", "3"};
    for (int i = 0; CU_TEST_BACKEND == KVQ_BACKEND_EMU && i < 3; i++)
        test_scheme(3, 3, 1, shuffles[i], seed + 10 + (unsigned long long)i);
    test_prod_refused();
    return th_summary();
}
