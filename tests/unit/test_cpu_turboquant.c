/* TurboQuant on the cpu backend (compiler/emit_llvm_turboquant.c) against the reference backend, through the
 * public API: every scheme of specs/rotate/turboquant.kvq, turboquant-2.5bit.kvq and turboquant-3.5bit.kvq (Q_mse
 * values and keys, Q_prod keys with their QJL term, the outlier channel split), on the same inputs in lockstep:
 * every decode step's attention within 1e-3 (relative), the same cache read back (the storage is the
 * reference's), the same statistics. Shapes cover GQA 1, 4 and 8, head_dim 64, 96, 128 and 256, batches whose
 * sequences choose their own outlier channels, decodes that cross the appendable pages' 128-token boundary, and
 * one and two threads; each scheme runs three of them at the host's vector width, and two schemes (prod keys,
 * without and with the split) two of them at 4 lanes. The cuda (emulator) backend's TurboQuant is checked by
 * test_cuda_turboquant. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "test_engine_util.h"
#include "test_lockstep.h"

#define KVH 2

static const tu_shape shapes[] = {
    {97, 1, 1, 128, 1, 40}, {200, 2, 4, 128, 2, 60}, {17, 3, 8, 96, 2, 6}, {60, 1, 4, 64, 1, 6}, {300, 1, 1, 256, 2, 4},
};
#define N_SHAPES ((int)(sizeof shapes / sizeof shapes[0]))

static const struct {
    const char *file, *name;
} schemes[] = {
    {"specs/rotate/turboquant.kvq", "turboquant-k3v2"},         {"specs/rotate/turboquant.kvq", "turboquant-k4v3"},
    {"specs/rotate/turboquant.kvq", "turboquant-mse3"},         {"specs/rotate/turboquant-2.5bit.kvq", "turboquant-2p5"},
    {"specs/rotate/turboquant-2.5bit.kvq", "turboquant-32x3-96x2"}, {"specs/rotate/turboquant-3.5bit.kvq", "turboquant-3p5"},
};
#define N_SCHEMES ((int)(sizeof schemes / sizeof schemes[0]))

/* Scheme si on `n` of the shapes, starting at shape `first` (every shape meets several schemes; the TurboQuant
 * code paths are few: mse rows, prod's QJL term, one or two parts). */
static void test_scheme(int si, const char *width, int first, int n)
{
    th_begin("cpu vs reference: %s (%s)%s%s: every decode step within 1e-3, same cache and statistics",
             schemes[si].name, schemes[si].file, width ? " at vector width " : "", width ? width : "");
    kvq_spec *f = tu_spec_file(schemes[si].file);
    const kvq_scheme *s = f ? kvq_spec_scheme(f, schemes[si].name) : NULL;
    TH_CHECK(s, "scheme");
    for (int r = 0; r < n && !th_failed(); r++) {
        const tu_shape *sh = &shapes[(first + r) % N_SHAPES];
        double w = tu_lockstep_compare(s, KVQ_BACKEND_CPU, sh, KVH);
        if (w == -3)
            printf("  %s at head_dim %d: refused by both (%s)\n", schemes[si].name, sh->D, "no regular channels");
        else if (w >= 0)
            printf("  %s len %d batch %d gqa %d D %d threads %d steps %d: worst relative error %.2e\n", schemes[si].name,
                   sh->len, sh->batch, sh->gqa, sh->D, sh->threads, sh->steps, w);
        else
            printf("  failed at len %d batch %d gqa %d D %d threads %d\n", sh->len, sh->batch, sh->gqa, sh->D,
                   sh->threads);
    }
    kvq_spec_free(f);
    th_end();
}

/* Whether this build has the cpu backend (LLVM); else every case is a SKIP with the reason. */
static int cpu_available(char *why, size_t n)
{
    kvq_spec *f = tu_spec_text("scheme p { bits 4; }\n");
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){1, 2, 2, 64};
    cfg.backend = KVQ_BACKEND_CPU;
    kvq_engine *e = NULL;
    kvq_status st = f ? kvq_engine_create(kvq_spec_scheme(f, "p"), &cfg, &e, why, n) : KVQ_ERR_INVALID;
    kvq_engine_free(e);
    kvq_spec_free(f);
    return st != KVQ_ERR_UNAVAILABLE;
}

int main(void)
{
    char why[256] = "";
    if (!cpu_available(why, sizeof why)) {
        for (int i = 0; i < N_SCHEMES; i++) printf("SKIP cpu vs reference: %s: %s\n", schemes[i].name, why);
        return th_summary();
    }
    for (int i = 0; i < N_SCHEMES; i++) test_scheme(i, NULL, i, 3);
    /* the 4-lane vectors (SSE) on a wider host: the other lane layout of the codes and the QJL signs (prod keys
     * without and with the split) */
    if (setenv("KVQ_CPU_VECTOR_WIDTH", "4", 1) == 0) {
        test_scheme(0, "4", 0, 2);
        test_scheme(5, "4", 2, 2); /* head_dim 96, and 64: no regular channels, refused by both */
    }
    unsetenv("KVQ_CPU_VECTOR_WIDTH");
    return th_summary();
}
