/* Emulator: the device element formats of templates/kvq_format.cuh against the reference's (runtime/quant.c,
 * base/minifloat.c), bit for bit:
 *   - fp8 e4m3 / e5m2 and e2m1 encodes on every code's value, its fp32 neighbours, every midpoint between
 *     neighbouring codes (ties to even) and its neighbours, +-0, +-inf, NaN, saturating values, fp32
 *     subnormals and 2^17 random values over the whole exponent range;
 *   - every code's level, each format (the NaN/inf codes decode to 0 as the reference's table does);
 *   - group quantizers of every format (q8_0, q4_0, q4_1, q5_0, q5_1, int symmetric 4/8, e4m3/e5m2 with a
 *     tensor scale, nvfp4, mxfp4, explicit and Lloyd-Max codebooks) on random groups of every magnitude, groups
 *     on exact rounding ties, constant, all-zero and +-max groups: codes, stored scale and zero identical. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "emu_test.h"
#include "lloyd_max.h"
#include "minifloat.h"
#include "params.h"
#include "quant.h"

EMU_KERNEL_DECLARE(format_items);

static int run(struct format_params *p)
{
    const unsigned nt = 128;
    LAUNCH_OK(EMU_KERNEL(format_items), d3(((unsigned)p->n + nt - 1) / nt, 1, 1), d3(nt, 1, 1), 0, p, NULL);
    return 1;
}

static float rnd_float(uint64_t *seed)
{
    /* sign, exponent over fp32's whole range (weighted toward the formats' ranges), random mantissa */
    uint32_t r = test_rand(seed) ^ test_rand(seed) << 16;
    int e = (int)(test_rand(seed) % 4 == 0 ? test_rand(seed) % 254 : 100 + test_rand(seed) % 50);
    uint32_t u = (r & 0x807fffffu) | (uint32_t)e << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float next_up(float x) { return nextafterf(x, INFINITY); }
static float next_dn(float x) { return nextafterf(x, -INFINITY); }

/* values around every code of a minifloat: the value, its neighbours, the midpoints and theirs */
static int edge_values(float (*dec)(uint8_t), int n_codes, float *out)
{
    int k = 0;
    float v[256];
    int nv = 0;
    for (int c = 0; c < n_codes; c++) {
        float y = dec((uint8_t)c);
        if (isfinite(y) && y >= 0) v[nv++] = y;
    }
    for (int i = 0; i < nv; i++)
        for (int s = 0; s < 2; s++) {
            float sg = s ? -1.0f : 1.0f, y = v[i];
            out[k++] = sg * y, out[k++] = sg * next_up(y), out[k++] = sg * next_dn(y);
            for (int j = 0; j < nv; j++) /* the next larger code's midpoint */
                if (v[j] > y) {
                    float best = v[j];
                    for (int m = 0; m < nv; m++)
                        if (v[m] > y && v[m] < best) best = v[m];
                    float mid = (float)(((double)y + (double)best) / 2);
                    out[k++] = sg * mid, out[k++] = sg * next_up(mid), out[k++] = sg * next_dn(mid);
                    break;
                }
        }
    const float extra[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e30f, -1e30f, 1e-40f, -1e-40f, 1e-45f,
                           65504.0f, 464.0f, 480.0f, 61440.0f, 7.0f, -5.5f, 1e-3f};
    for (size_t i = 0; i < sizeof extra / sizeof *extra; i++) out[k++] = extra[i];
    return k;
}

static void check_encode(const char *name, int kind, float (*dec)(uint8_t), uint8_t (*enc)(float), uint64_t *seed)
{
    th_begin("emu format: %s encode (codes, neighbours, ties, saturation, NaN, random) = base/minifloat.c", name);
    enum { NR = 1 << 17 };
    float *x = malloc((NR + 256 * 12 + 64) * sizeof *x);
    uint8_t *codes = malloc(NR + 256 * 12 + 64);
    TH_CHECK(x && codes, "out of memory");
    if (x && codes) {
        int n = edge_values(dec, kind < 0 ? 16 : 256, x);
        for (int i = 0; i < NR; i++) x[n++] = rnd_float(seed);
        struct format_params p = {x, codes, NULL, NULL, NULL, NULL, 0, kind, 8, 0, n, 0, 0, 0, 1.0f};
        if (run(&p)) {
            int bad = 0;
            for (int i = 0; i < n && bad < 5; i++)
                if (codes[i] != enc(x[i])) {
                    TH_CHECK(0, "%s(%a = %g): device 0x%02x, reference 0x%02x", name, (double)x[i], (double)x[i],
                             codes[i], enc(x[i]));
                    bad++;
                }
        }
    }
    free(x), free(codes);
    th_end();
}

static void check_levels(const char *name, const kvq_format_cfg *f, int bits)
{
    th_begin("emu format: %s level of every code = runtime/quant.c kvq_format_levels", name);
    float want[256], got[256];
    unsigned char codes[256];
    int cb = kvq_format_code_bits(f, bits), n = 1 << cb;
    kvq_format_levels(f, bits, want);
    for (int c = 0; c < n; c++) codes[c] = (unsigned char)c;
    struct format_params p = {NULL, codes, got, NULL, NULL, f->levels, 1, (int)f->kind, bits, 0, n, 0,
                              f->codebook_normal, f->n_levels, 1.0f};
    if (run(&p))
        for (int c = 0; c < n; c++)
            if (memcmp(&got[c], &want[c], 4)) {
                TH_CHECK(0, "%s code %d: device %a, reference %a", name, c, (double)got[c], (double)want[c]);
                break;
            }
    th_end();
}

/* groups: random magnitudes, ties on the format's grid, constant, zero, +-max of equal magnitude */
static void fill_groups(float *x, int ng, int G, uint64_t *seed)
{
    for (int g = 0; g < ng; g++) {
        float *y = x + (size_t)g * G;
        int kind = g % 8;
        float mag = ldexpf(1.0f, (int)(test_rand(seed) % 24) - 12);
        for (int i = 0; i < G; i++) {
            float u = (float)((int)(test_rand(seed) % 2001) - 1000) / 1000.0f;
            if (kind == 0 || kind == 1) y[i] = u * mag;
            else if (kind == 2) y[i] = (float)((int)(test_rand(seed) % 33) - 16) * 0.5f * mag; /* .5 ties */
            else if (kind == 3) /* q8_0's d = absmax / 127 exact, x / d on a half: roundf's ties */
                y[i] = i == 0 ? 127.0f * mag : ((float)((int)(test_rand(seed) % 254) - 127) + 0.5f) * mag;
            else if (kind == 4) y[i] = 1.5f * mag;
            else if (kind == 5) y[i] = 0.0f;
            else if (kind == 6) y[i] = i == 3 ? -mag : i == 7 ? mag : u * mag / 2; /* -max first */
            else y[i] = rnd_float(seed) * 0 + u * u * u * mag * 64;
        }
        if (kind == 1) y[test_rand(seed) % G] = 60000.0f * (test_rand(seed) & 1 ? 1 : -1) * (mag > 1 ? 1 : mag);
    }
}

static void check_groups(const char *name, const kvq_format_cfg *f, int bits, int G, int s_f32, float T,
                         uint64_t *seed)
{
    th_begin("emu format: %s groups of %d (scale %s, T %g): codes, scale and zero = runtime/quant.c", name, G,
             s_f32 ? "fp32" : "fp16", (double)T);
    enum { NG = 4096 };
    float *x = malloc((size_t)NG * G * sizeof *x), s[NG], z[NG];
    uint8_t *codes = malloc((size_t)NG * G), *want = malloc((size_t)G);
    TH_CHECK(x && codes && want, "out of memory");
    if (x && codes && want) {
        fill_groups(x, NG, G, seed);
        struct format_params p = {x, codes, NULL, s, z, f->levels, 2, (int)f->kind, bits, s_f32, NG, G,
                                  f->codebook_normal, f->n_levels, T};
        int bad = 0;
        if (run(&p))
            for (int g = 0; g < NG && bad < 3; g++) {
                kvq_param_dtype dt = s_f32 ? KVQ_DT_FP32 : KVQ_DT_FP16;
                kvq_qparams q = kvq_format_quantize_group(f, bits, dt, dt, T, x + (size_t)g * G, (size_t)G, 1, want);
                if (memcmp(&q.scale, &s[g], 4) || memcmp(&q.zero, &z[g], 4) ||
                    memcmp(want, codes + (size_t)g * G, (size_t)G)) {
                    int c = 0;
                    while (c < G - 1 && want[c] == codes[(size_t)g * G + c]) c++;
                    TH_CHECK(0, "%s group %d: scale %a/%a zero %a/%a (device/reference), x[%d] = %a: code %d/%d",
                             name, g, (double)s[g], (double)q.scale, (double)z[g], (double)q.zero, c,
                             (double)x[(size_t)g * G + c], codes[(size_t)g * G + c], want[c]);
                    bad++;
                }
            }
    }
    free(x), free(codes), free(want);
    th_end();
}

/* packed rows (runtime/quant.c kvq_pack_codes) read back by kvq_fmt_code_at, 1 to 8 bits */
static void check_code_read(int bits, uint64_t *seed)
{
    th_begin("emu format: %d-bit codes read from rows packed by kvq_pack_codes", bits);
    enum { D = 128, R = 64 };
    uint8_t codes[R * D], buf[2 * R * D];
    memset(buf, 0, sizeof buf);
    for (int i = 0; i < R * D; i++) codes[i] = (uint8_t)(test_rand(seed) & ((1u << bits) - 1u));
    for (int c = 0; c < D; c++) codes[c] = (uint8_t)((1u << bits) - 1u); /* a row of largest codes */
    for (int r = 0; r < R; r++) kvq_pack_codes(codes + r * D, D, bits, buf + r * (D * bits / 8));
    struct format_params p = {NULL, buf, NULL, NULL, NULL, NULL, 3, 0, bits, 0, R * D, 0, 0, 0, 1.0f};
    uint8_t *got = buf + R * D; /* after the largest rows (8 bits) */
    if (run(&p))
        for (int i = 0; i < R * D; i++)
            if (got[i] != codes[i]) {
                TH_CHECK(0, "row %d channel %d: device %d, packed %d", i / D, i % D, got[i], codes[i]);
                break;
            }
    th_end();
}

/* 1-byte block scales: every scale the nvfp4 / mxfp4 quantizers can produce, stored and read back */
static void check_scale8(const char *name, kvq_format_kind kind)
{
    th_begin("emu format: %s block scale bytes = kvq_format_scale8_encode, read back exactly", name);
    float s[256], y[256];
    uint8_t got[256];
    int n = 0;
    for (int c = 0; c < 256; c++) {
        float v = kvq_format_scale8_decode(kind, (uint8_t)c);
        if (isfinite(v) && v >= 0 && !(kind == KVQ_FMT_NVFP4 && c >= 0x80)) s[n++] = v;
    }
    struct format_params p = {NULL, got, y, s, NULL, NULL, 4, (int)kind, 4, 0, n, 0, 0, 0, 1.0f};
    if (run(&p))
        for (int i = 0; i < n; i++)
            if (got[i] != kvq_format_scale8_encode(kind, s[i]) || memcmp(&y[i], &s[i], 4)) {
                TH_CHECK(0, "scale %a: device byte 0x%02x (reference 0x%02x), read back %a", (double)s[i], got[i],
                         kvq_format_scale8_encode(kind, s[i]), (double)y[i]);
                break;
            }
    th_end();
}

int main(void)
{
    uint64_t seed = 2020;
    th_begin("emu format: kind numbers match compiler/scheme_format.h");
    TH_CHECK(KVQ_FMT_INT_SYM == 1 && KVQ_FMT_Q8_0 == 2 && KVQ_FMT_Q5_1 == 6 && KVQ_FMT_E4M3 == 7 &&
                 KVQ_FMT_NVFP4 == 9 && KVQ_FMT_MXFP4 == 10 && KVQ_FMT_CODEBOOK == 11,
             "templates/kvq_format.cuh's KVQ_FK_* are out of step with kvq_format_kind");
    th_end();
    check_encode("e4m3", KVQ_FMT_E4M3, kvq_f32_from_e4m3, kvq_e4m3_from_f32, &seed);
    check_encode("e5m2", KVQ_FMT_E5M2, kvq_f32_from_e5m2, kvq_e5m2_from_f32, &seed);
    check_encode("e2m1", -1, kvq_f32_from_e2m1, kvq_e2m1_from_f32, &seed);

    kvq_format_cfg f;
    static const struct {
        const char *name;
        kvq_format_kind kind;
        int bits, group;
        float T;
    } fmts[] = {{"q8_0", KVQ_FMT_Q8_0, 8, 32, 1},       {"q4_0", KVQ_FMT_Q4_0, 4, 32, 1},
                {"q4_1", KVQ_FMT_Q4_1, 4, 32, 1},       {"q5_0", KVQ_FMT_Q5_0, 5, 32, 1},
                {"q5_1", KVQ_FMT_Q5_1, 5, 32, 1},       {"int4 symmetric", KVQ_FMT_INT_SYM, 4, 32, 1},
                {"int8 symmetric", KVQ_FMT_INT_SYM, 8, 32, 1}, {"int2", KVQ_FMT_INT, 2, 32, 1},
                {"e4m3", KVQ_FMT_E4M3, 8, 32, 0.0123f}, {"e5m2", KVQ_FMT_E5M2, 8, 32, 1},
                {"nvfp4", KVQ_FMT_NVFP4, 4, 16, 0.0371f}, {"nvfp4 T=1", KVQ_FMT_NVFP4, 4, 16, 1},
                {"mxfp4", KVQ_FMT_MXFP4, 4, 32, 1}};
    for (size_t i = 0; i < sizeof fmts / sizeof *fmts; i++) {
        memset(&f, 0, sizeof f);
        f.kind = fmts[i].kind;
        check_levels(fmts[i].name, &f, fmts[i].bits);
        check_groups(fmts[i].name, &f, fmts[i].bits, fmts[i].group, 0, fmts[i].T, &seed);
        if (f.kind == KVQ_FMT_INT_SYM || f.kind == KVQ_FMT_INT)
            check_groups(fmts[i].name, &f, fmts[i].bits, fmts[i].group, 1, 1, &seed);
    }
    /* codebooks: explicit levels (fewer than 2^bits), and Lloyd-Max for N(0,1) at 2 and 4 bits */
    memset(&f, 0, sizeof f);
    f.kind = KVQ_FMT_CODEBOOK;
    const float lv[] = {-1.0f, -0.4f, -0.1f, 0.0f, 0.1f, 0.4f, 1.0f};
    f.n_levels = 7;
    memcpy(f.levels, lv, sizeof lv);
    check_levels("codebook (7 levels, 3 bits)", &f, 3);
    check_groups("codebook (7 levels, 3 bits)", &f, 3, 32, 0, 1, &seed);
    for (int b = 2; b <= 4; b += 2) {
        double L[16], mse;
        memset(&f, 0, sizeof f);
        f.kind = KVQ_FMT_CODEBOOK;
        f.codebook_normal = 1;
        th_begin("emu format: Lloyd-Max levels for %d bits", b);
        TH_CHECK(kvq_lloyd_max_normal(b, 1.0, L, &mse) == 0, "kvq_lloyd_max_normal failed");
        th_end();
        f.n_levels = 1 << b;
        for (int i = 0; i < f.n_levels; i++) f.levels[i] = (float)L[i];
        check_levels(b == 2 ? "codebook normal 2" : "codebook normal 4", &f, b);
        check_groups(b == 2 ? "codebook normal 2" : "codebook normal 4", &f, b, 32, 0, 1, &seed);
        check_groups(b == 2 ? "codebook normal 2" : "codebook normal 4", &f, b, 32, 1, 1, &seed);
    }
    for (int b = 1; b <= 8; b++)
        if (b != 6 && b != 7) check_code_read(b, &seed);
    check_scale8("nvfp4 (e4m3)", KVQ_FMT_NVFP4);
    check_scale8("mxfp4 (e8m0)", KVQ_FMT_MXFP4);
    emu_release();
    return th_summary();
}
