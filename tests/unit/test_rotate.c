/* Rotations (docs/language.md "Rotations", docs/runtime.md "Rotations"): the matrices (orthogonal, the specified
 * generator's pinned values, Hadamard = Sylvester / Paley), the language, the engine's application (attention of
 * a rotated near-lossless scheme equals exact attention; read_cache in the caller's basis), the count of
 * rotations per decode step (q once per head per step, whatever the length), and the cpu backend against the
 * reference on rotated schemes. The emu backend's comparison is test_cuda_rotate.c. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rotation.h"
#include "rt_internal.h"
#include "test_rotate_util.h"

/* kvq_rng_next's first draw of stream HAAR seed 1, and entries of `rotate random seed 1` at D = 128. */
#define PIN_FIRST 10826817899565491160ull
#define PIN_M00 0.024334377362129411
#define PIN_M577 -0.036603381536376031
#define PIN_MLAST -0.007751579215023615

static const int dims[] = {64, 96, 128, 256};

/* R R^T = I: rotate each unit vector, rotate back, and check the Gram matrix of the rotated basis. */
static void test_orthogonal(kvq_rotation kind, int seed)
{
    for (int di = 0; di < 4; di++) {
        int D = dims[di];
        th_begin("rotation %s seed %d, D %d: orthogonal, inverse exact to 1e-6", kind == KVQ_ROT_HADAMARD ? "hadamard" : "random",
                 seed, D);
        kvq_rot r;
        TH_CHECK(kvq_rot_build(&r, kind, seed, D) == KVQ_OK, "build");
        float *cols = calloc((size_t)D * D, sizeof *cols);
        for (int j = 0; j < D && !th_failed(); j++) {
            float *c = cols + (size_t)j * D;
            c[j] = 1;
            kvq_rot_apply(&r, c, 0);
        }
        double worst = 0, worst_inv = 0;
        for (int i = 0; i < D; i++)
            for (int j = 0; j < D; j++) {
                double s = 0;
                for (int c = 0; c < D; c++) s += (double)cols[(size_t)i * D + c] * cols[(size_t)j * D + c];
                worst = fmax(worst, fabs(s - (i == j)));
            }
        for (int j = 0; j < D; j++) {
            float *c = cols + (size_t)j * D;
            kvq_rot_apply(&r, c, 1);
            for (int i = 0; i < D; i++) worst_inv = fmax(worst_inv, fabs(c[i] - (i == j)));
        }
        TH_CHECK(worst < 1e-6 && worst_inv < 1e-6, "|R^T R - I| %.3g, |R^T R e - e| %.3g", worst, worst_inv);
        free(cols);
        kvq_rot_free(&r);
        th_end();
    }
}

/* Without signs, R sqrt(D) is a Hadamard matrix: every entry +-1; for powers of two Sylvester's (entry (i, j) is
 * (-1)^popcount(i & j)). D = 96 is H_12 (x) H_8 (its entries +-1 and orthogonality prove a Hadamard matrix). */
static void test_hadamard_entries(void)
{
    for (int di = 0; di < 4; di++) {
        int D = dims[di];
        th_begin("hadamard D %d: sqrt(D) R has entries +-1 (Sylvester's for powers of two), signs flip columns", D);
        kvq_rot r, rs;
        TH_CHECK(kvq_rot_build(&r, KVQ_ROT_HADAMARD, -1, D) == KVQ_OK &&
                     kvq_rot_build(&rs, KVQ_ROT_HADAMARD, 9, D) == KVQ_OK,
                 "build");
        float e[256], f[256];
        int flipped = 0;
        for (int j = 0; j < D && !th_failed(); j++) {
            memset(e, 0, sizeof e);
            memset(f, 0, sizeof f);
            e[j] = f[j] = 1;
            kvq_rot_apply(&r, e, 0);
            kvq_rot_apply(&rs, f, 0);
            double sign = f[0] * e[0] > 0 ? 1 : -1;
            flipped += sign < 0;
            for (int i = 0; i < D; i++) {
                double v = e[i] * sqrt((double)D);
                TH_CHECK(fabs(fabs(v) - 1) < 1e-6, "entry (%d, %d) = %g", i, j, v);
                if (D != 96) TH_CHECK(fabs(v - (__builtin_popcount((unsigned)(i & j)) % 2 ? -1 : 1)) < 1e-6, "Sylvester (%d, %d)", i, j);
                TH_CHECK(fabs(f[i] - sign * e[i]) < 1e-6, "signed column %d is not +-the plain one", j);
                if (th_failed()) break;
            }
        }
        TH_CHECK(flipped > D / 4 && flipped < 3 * D / 4, "%d of %d columns flipped by seed 9", flipped, D);
        kvq_rot_free(&r);
        kvq_rot_free(&rs);
        th_end();
    }
}

/* The generator is part of the language: these values must never change (a spec's `rotate random seed 1` names
 * this matrix on every machine). Printed with %.17g when first computed. */
static void test_pinned(void)
{
    th_begin("rotate random seed 1, D 128: the specified generator builds the pinned matrix");
    kvq_rng g;
    kvq_rng_seed(&g, KVQ_RNG_STREAM_HAAR, 1);
    uint64_t first = kvq_rng_next(&g);
    double lg = kvq_rng_log(0.3), lg2 = kvq_rng_log(1e-300);
    TH_CHECK(fabs(lg - log(0.3)) <= 1e-15 && fabs(lg2 - log(1e-300)) <= 1e-12, "log %.17g %.17g", lg, lg2);
    kvq_rot r;
    TH_CHECK(kvq_rot_build(&r, KVQ_ROT_RANDOM, 1, 128) == KVQ_OK, "build");
    if (!th_failed()) {
        printf("  first draw %llu, m[0][0] %.17g, m[5][77] %.17g, m[127][127] %.17g\n", (unsigned long long)first,
               r.m[0], r.m[5 * 128 + 77], r.m[127 * 128 + 127]);
        TH_CHECK(first == PIN_FIRST, "first draw %llu", (unsigned long long)first);
        TH_CHECK(r.m[0] == PIN_M00 && r.m[5 * 128 + 77] == PIN_M577 && r.m[127 * 128 + 127] == PIN_MLAST,
                 "matrix entries differ from the pinned ones");
    }
    /* the normals: mean 0, variance 1 (200000 draws: standard error 0.0022 and 0.0032) */
    double s = 0, s2 = 0;
    kvq_rng_seed(&g, KVQ_RNG_STREAM_QJL, 4);
    for (int i = 0; i < 200000; i++) {
        double z = kvq_rng_normal(&g);
        s += z;
        s2 += z * z;
    }
    TH_CHECK(fabs(s / 200000) < 0.01 && fabs(s2 / 200000 - 1) < 0.015, "mean %g, second moment %g", s / 200000,
             s2 / 200000);
    kvq_rot_free(&r);
    th_end();
}

static void test_language(void)
{
    th_begin("language: rotate hadamard [seed S], rotate random seed S, rotate none; inherited and per tensor");
    kvq_spec *sp = tu_spec_text("scheme a { bits 2; rotate hadamard; value { rotate random seed 12; } }\n"
                                "scheme b : a { key { rotate hadamard seed 4; } }\n"
                                "scheme c : b { rotate none; layers 1 { key { rotate random seed 0; } } }\n");
    const kvq_scheme *a = sp ? kvq_spec_scheme(sp, "a") : NULL, *b = sp ? kvq_spec_scheme(sp, "b") : NULL;
    const kvq_scheme *c = sp ? kvq_spec_scheme(sp, "c") : NULL;
    TH_CHECK(a && b && c, "schemes");
    if (a && b && c) {
        TH_CHECK(a->base.quant.key.rotate == KVQ_ROT_HADAMARD && a->base.quant.key.rotate_seed == -1, "a key");
        TH_CHECK(a->base.quant.value.rotate == KVQ_ROT_RANDOM && a->base.quant.value.rotate_seed == 12, "a value");
        TH_CHECK(b->base.quant.key.rotate == KVQ_ROT_HADAMARD && b->base.quant.key.rotate_seed == 4, "b key");
        TH_CHECK(b->base.quant.value.rotate == KVQ_ROT_RANDOM, "b value inherited");
        TH_CHECK(c->base.quant.key.rotate == KVQ_ROT_NONE && c->base.quant.value.rotate == KVQ_ROT_NONE, "c none");
        const kvq_layer_cfg *l1 = kvq_scheme_layer(c, 1);
        TH_CHECK(l1->quant.key.rotate == KVQ_ROT_RANDOM && l1->quant.key.rotate_seed == 0 &&
                     l1->quant.value.rotate == KVQ_ROT_NONE,
                 "c layer 1");
    }
    kvq_spec_free(sp);
    /* the study's specs (docs/eval.md) */
    sp = tu_spec_file("specs/rotate/kivi-hadamard.kvq");
    const kvq_scheme *h = sp ? kvq_spec_scheme(sp, "kivi2-hadamard") : NULL;
    TH_CHECK(h && h->base.quant.key.rotate == KVQ_ROT_HADAMARD && h->base.quant.value.rotate == KVQ_ROT_HADAMARD &&
                 h->base.quant.key.bits == 2 && h->base.quant.residual == 128,
             "specs/rotate/kivi-hadamard.kvq: kivi2-hadamard");
    kvq_spec_free(sp);
    th_end();
}

/* A near-lossless rotated scheme (8 bits) attends like exact attention on the caller's K/V, and read_cache
 * gives back the caller's basis: the rotation is undone where it must be, for every head_dim. */
static void test_engine_exact(void)
{
    for (int di = 0; di < 4; di++) {
        int D = dims[di], H = 2, Hq = 4, n = 70;
        th_begin("engine: kivi8 rotated (hadamard keys, random values), D %d: output within 1e-2 of exact attention, "
                 "read_cache within 8-bit error of the input",
                 D);
        kvq_spec *sp = tu_spec_text("scheme r8 { key { bits 8; per channel; group 32; rotate hadamard seed 5; }\n"
                                    "  value { bits 8; per token; group 32; rotate random seed 8; } residual 32; }\n");
        kvq_engine *e = sp ? tu_engine(kvq_spec_scheme(sp, "r8"), 1, Hq, H, D, KVQ_F32) : NULL;
        kvq_seq *s = NULL;
        float *k = malloc((size_t)H * (n + 1) * D * 4), *v = malloc((size_t)H * (n + 1) * D * 4);
        float *q = malloc((size_t)Hq * n * D * 4), *out = malloc((size_t)Hq * D * 4), *ex = malloc((size_t)D * 4);
        tu_fill(k, (size_t)H * (n + 1) * D, 2);
        tu_fill(v, (size_t)H * (n + 1) * D, 1);
        tu_fill(q, (size_t)Hq * n * D, 1);
        TH_CHECK(e && kvq_seq_create(e, &s) == KVQ_OK, "engine");
        /* prompt: the first n - 1 tokens of each head, then one decode step */
        float *pk = tr_rows(k, H, (size_t)n + 1, D, 0, n - 1), *pv = tr_rows(v, H, (size_t)n + 1, D, 0, n - 1);
        kvq_prefill_item it = {s, n - 1, pk, pv, NULL};
        TH_CHECK(!th_failed() && kvq_prefill(e, 0, &it, 1) == KVQ_OK, "prefill: %s", kvq_engine_errmsg(e));
        float *dk = tr_rows(k, H, (size_t)n + 1, D, (size_t)n - 1, 1), *dv = tr_rows(v, H, (size_t)n + 1, D, (size_t)n - 1, 1);
        kvq_decode_item d = {s, dk, dv, q, out};
        TH_CHECK(!th_failed() && kvq_decode(e, 0, &d, 1) == KVQ_OK, "decode: %s", kvq_engine_errmsg(e));
        for (int h = 0; h < Hq && !th_failed(); h++) {
            int g = h / (Hq / H);
            float *K = tr_rows(k, H, (size_t)n + 1, D, 0, n), *V = tr_rows(v, H, (size_t)n + 1, D, 0, n);
            tu_exact_attention(q + (size_t)h * D, K + (size_t)g * n * D, V + (size_t)g * n * D, n, D,
                               1 / sqrt((double)D), ex);
            double rel = tu_rel_err(out + (size_t)h * D, ex, (size_t)D, 1e-3);
            TH_CHECK(rel < 1e-2, "head %d: error %.3g of the magnitude", h, rel);
            free(K), free(V);
        }
        float *rk = malloc((size_t)H * n * D * 4), *rv = malloc((size_t)H * n * D * 4);
        int got = 0;
        TH_CHECK(!th_failed() && kvq_seq_read_cache(e, s, 0, rk, rv, n, &got) == KVQ_OK && got == n, "read_cache");
        float *K = tr_rows(k, H, (size_t)n + 1, D, 0, n), *V = tr_rows(v, H, (size_t)n + 1, D, 0, n);
        double ek = tu_max_abs_diff(rk, K, (size_t)H * n * D), ev = tu_max_abs_diff(rv, V, (size_t)H * n * D);
        TH_CHECK(!th_failed() && ek < 0.1 && ev < 0.05, "read_cache off the input by %g (k) %g (v)", ek, ev);
        free(K), free(V), free(rk), free(rv), free(pk), free(pv), free(dk), free(dv);
        free(k), free(v), free(q), free(out), free(ex);
        kvq_engine_free(e);
        kvq_spec_free(sp);
        th_end();
    }
}

/* Count the operations: a decode step rotates each query head once, each new K/V row once and each output row
 * once, at length T and at length 2T alike (no per-token rotation: the backends never see one). */
static void test_counts(void)
{
    th_begin("engine: a decode step rotates q once per head, not per token (counts at T = 200 and T = 400)");
    const int D = 128, H = 2, Hq = 8;
    kvq_spec *sp = tu_spec_text("scheme r { bits 2; key { per channel; } value { per token; } residual 32;\n"
                                "  rotate hadamard seed 2; }\n");
    kvq_engine *e = sp ? tu_engine(kvq_spec_scheme(sp, "r"), 1, Hq, H, D, KVQ_F32) : NULL;
    for (int T = 200; T <= 400 && e; T += 200) {
        kvq_seq *s = NULL;
        float *k = malloc((size_t)H * T * D * 4), *v = malloc((size_t)H * T * D * 4), *q = malloc((size_t)Hq * D * 4);
        float *out = malloc((size_t)Hq * D * 4);
        tu_fill(k, (size_t)H * T * D, 1);
        tu_fill(v, (size_t)H * T * D, 1);
        tu_fill(q, (size_t)Hq * D, 1);
        TH_CHECK(kvq_seq_create(e, &s) == KVQ_OK, "seq");
        kvq_prefill_item it = {s, T, k, v, NULL};
        TH_CHECK(kvq_prefill(e, 0, &it, 1) == KVQ_OK, "prefill: %s", kvq_engine_errmsg(e));
        TH_CHECK(e->rot_count[RT_ROT_K] == (uint64_t)H * T && e->rot_count[RT_ROT_V] == (uint64_t)H * T &&
                     e->rot_count[RT_ROT_Q] == 0,
                 "prefill of %d: %llu key, %llu value, %llu query rotations", T,
                 (unsigned long long)e->rot_count[RT_ROT_K], (unsigned long long)e->rot_count[RT_ROT_V],
                 (unsigned long long)e->rot_count[RT_ROT_Q]);
        for (int step = 0; step < 3 && !th_failed(); step++) {
            uint64_t before[RT_ROT_KINDS];
            memcpy(before, e->rot_count, sizeof before);
            kvq_decode_item d = {s, k, v, q, out};
            TH_CHECK(kvq_decode(e, 0, &d, 1) == KVQ_OK, "decode: %s", kvq_engine_errmsg(e));
            uint64_t dq = e->rot_count[RT_ROT_Q] - before[RT_ROT_Q], dout = e->rot_count[RT_ROT_OUT] - before[RT_ROT_OUT];
            uint64_t dk = e->rot_count[RT_ROT_K] - before[RT_ROT_K], dv = e->rot_count[RT_ROT_V] - before[RT_ROT_V];
            TH_CHECK(dq == (uint64_t)Hq && dout == (uint64_t)Hq && dk == (uint64_t)H && dv == (uint64_t)H,
                     "length %d step %d: %llu q, %llu out, %llu k, %llu v rotations (want %d, %d, %d, %d)", T, step,
                     (unsigned long long)dq, (unsigned long long)dout, (unsigned long long)dk, (unsigned long long)dv,
                     Hq, Hq, H, H);
        }
        kvq_seq_free(e, s);
        memset(e->rot_count, 0, sizeof e->rot_count);
        free(k), free(v), free(q), free(out);
    }
    kvq_engine_free(e);
    kvq_spec_free(sp);
    th_end();
}

/* A rotated element beyond fp16's range is refused with a message naming the rotation; nothing is stored. */
static void test_rotated_range(void)
{
    th_begin("engine: a key within fp16's range whose rotation is not is refused (KVQ_ERR_INVALID), nothing stored");
    const int D = 64;
    kvq_spec *sp = tu_spec_text("scheme r { bits 4; rotate hadamard; }\n");
    kvq_engine *e = sp ? tu_engine(kvq_spec_scheme(sp, "r"), 1, 1, 1, D, KVQ_F32) : NULL;
    kvq_seq *s = NULL;
    TH_CHECK(e && kvq_seq_create(e, &s) == KVQ_OK, "engine");
    float k[64], v[64] = {0};
    for (int c = 0; c < D; c++) k[c] = 60000; /* H k = 8 * 60000 in channel 0 */
    kvq_prefill_item it = {s, 1, k, v, NULL};
    kvq_status st = e ? kvq_prefill(e, 0, &it, 1) : KVQ_ERR_INVALID;
    TH_CHECK(st == KVQ_ERR_INVALID && strstr(kvq_engine_errmsg(e), "k (rotated)"), "status %s: %s",
             kvq_status_str(st), e ? kvq_engine_errmsg(e) : "");
    TH_CHECK(kvq_seq_length(s, 0) == 0, "something was stored");
    kvq_engine_free(e);
    kvq_spec_free(sp);
    th_end();
}

int main(void)
{
    test_orthogonal(KVQ_ROT_HADAMARD, -1);
    test_orthogonal(KVQ_ROT_HADAMARD, 11);
    test_orthogonal(KVQ_ROT_RANDOM, 3);
    test_hadamard_entries();
    test_pinned();
    test_language();
    test_engine_exact();
    test_counts();
    test_rotated_range();
    kvq_spec *fp = tu_spec_text("scheme f { }");
    char err[256];
    kvq_engine *probe = fp ? tr_engine(kvq_spec_scheme(fp, NULL), KVQ_BACKEND_CPU, 1, 1, 1, 64, err, sizeof err) : NULL;
    kvq_engine_free(probe);
    kvq_spec_free(fp);
    if (!probe) {
        printf("SKIP cpu backend against the reference on rotated schemes: %s\n", err);
        return th_summary();
    }
    static const char *names[] = {"kivi2_had", "kivi4_rand", "ott_had", "zip_rand"};
    for (int i = 0; i < 4; i++)
        for (int di = 1; di < 3; di++) {
            th_begin("cpu backend against the reference: %s, D %d, 8 heads / 2 kv heads: decode within 1e-3, "
                     "read_cache identical",
                     names[i], dims[di]);
            tr_compare(tr_specs, names[i], KVQ_BACKEND_CPU, 8, 2, dims[di]);
            th_end();
        }
    return th_summary();
}
