/* The element formats of runtime/quant.h and base/minifloat.h on hand-worked values and blocks: every e4m3 /
 * e5m2 / e2m1 / e8m0 code decoded and re-encoded, the ties of each format, ggml's q8_0 / q4_0 / q4_1 / q5_0 /
 * q5_1 rounding on blocks worked out by hand from ggml-quants.c, MXFP4's shared exponent (OCP MX v1.0 Sec. 6.3),
 * NVFP4's two-level scale, symmetric integers, codebooks, the 5-bit packing. The bit-identity with gguf-py and
 * ml_dtypes on generated data is python/tests/test_formats.py. */
#include "half.h"
#include "harness.h"
#include "lloyd_max.h"
#include "minifloat.h"
#include "quant.h"

#include <math.h>
#include <string.h>

static kvq_format_cfg fmt(kvq_format_kind k)
{
    kvq_format_cfg f;
    memset(&f, 0, sizeof f);
    f.kind = k;
    f.tensor_scale = 1.0f;
    return f;
}

static kvq_qparams quant(kvq_format_kind k, int bits, float T, const float *x, int n, uint8_t *codes)
{
    kvq_format_cfg f = fmt(k);
    return kvq_format_quantize_group(&f, bits, KVQ_DT_FP16, KVQ_DT_FP16, T, x, (size_t)n, 1, codes);
}

int main(void)
{
    th_begin("formats.minifloat_every_code_round_trips");
    for (int c = 0; c < 256; c++) {
        float v = kvq_f32_from_e4m3((uint8_t)c);
        if ((c & 0x7f) == 0x7f)
            TH_CHECK(isnan(v), "e4m3 %#x not NaN", c);
        else
            TH_CHECK(kvq_e4m3_from_f32(v) == c, "e4m3 %#x -> %g -> %#x", c, v, kvq_e4m3_from_f32(v));
        v = kvq_f32_from_e5m2((uint8_t)c);
        if ((c & 0x7c) != 0x7c) TH_CHECK(kvq_e5m2_from_f32(v) == c, "e5m2 %#x -> %g", c, v);
        if (c < 255) TH_CHECK(kvq_e8m0_from_f32(kvq_f32_from_e8m0((uint8_t)c)) == c, "e8m0 %#x", c);
        if (c < 16) TH_CHECK(kvq_e2m1_from_f32(kvq_f32_from_e2m1((uint8_t)c)) == c, "e2m1 %#x", c);
    }
    TH_CHECK(kvq_f32_from_e4m3(0x7e) == 448.0f && kvq_f32_from_e4m3(0x01) == 0x1p-9f, "e4m3 max / min subnormal");
    TH_CHECK(kvq_f32_from_e5m2(0x7b) == 57344.0f && kvq_f32_from_e5m2(0x01) == 0x1p-16f, "e5m2 max / subnormal");
    TH_CHECK(isinf(kvq_f32_from_e5m2(0x7c)) && isnan(kvq_f32_from_e8m0(0xff)), "e5m2 inf, e8m0 NaN");
    {
        static const float e2m1[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
        for (int c = 0; c < 8; c++) TH_CHECK(kvq_f32_from_e2m1((uint8_t)c) == e2m1[c], "e2m1 %d", c);
        TH_CHECK(kvq_f32_from_e2m1(0x0f) == -6.0f, "e2m1 -6");
    }
    th_end();

    th_begin("formats.minifloat_ties_and_saturation");
    /* e4m3: 1.0 = 0x38, 1.125 = 0x39, 1.25 = 0x3a; ties go to the even code. */
    TH_CHECK(kvq_e4m3_from_f32(1.0625f) == 0x38 && kvq_e4m3_from_f32(1.1875f) == 0x3a, "e4m3 ties");
    TH_CHECK(kvq_e4m3_from_f32(1.0626f) == 0x39, "e4m3 above the tie");
    TH_CHECK(kvq_e4m3_from_f32(464.0f) == 0x7e && kvq_e4m3_from_f32(1e6f) == 0x7e && kvq_e4m3_from_f32(-1e6f) == 0xfe,
             "e4m3 saturates");
    TH_CHECK(kvq_e4m3_from_f32(0x1p-10f) == 0x00 && kvq_e4m3_from_f32(0x1.8p-10f) == 0x01, "e4m3 below subnormal");
    TH_CHECK(kvq_e4m3_from_f32(-0.0f) == 0x80 && kvq_e4m3_from_f32(NAN) == 0x7f, "e4m3 -0, NaN");
    TH_CHECK(kvq_e5m2_from_f32(1.125f) == 0x3c && kvq_e5m2_from_f32(1.375f) == 0x3e, "e5m2 ties");
    TH_CHECK(kvq_e5m2_from_f32(INFINITY) == 0x7b, "e5m2 saturates inf");
    /* e2m1: 0 0.5 1 1.5 2 3 4 6. */
    static const float xs[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 7.0f, 100.0f, -0.1f, -5.0f, 0.26f};
    static const uint8_t want[] = {0, 2, 2, 4, 4, 6, 6, 7, 7, 8, 14, 1};
    for (int i = 0; i < (int)(sizeof xs / sizeof xs[0]); i++)
        TH_CHECK(kvq_e2m1_from_f32(xs[i]) == want[i], "e2m1(%g) = %d, want %d", xs[i], kvq_e2m1_from_f32(xs[i]),
                 want[i]);
    /* e8m0: 2^(c - 127); a tie rounds up (ml_dtypes). */
    TH_CHECK(kvq_e8m0_from_f32(1.0f) == 127 && kvq_e8m0_from_f32(1.5f) == 128 && kvq_e8m0_from_f32(3.0f) == 129 &&
                 kvq_e8m0_from_f32(1.4f) == 127 && kvq_e8m0_from_f32(0.75f) == 127,
             "e8m0 rounding");
    th_end();

    th_begin("formats.q4_0_q5_0_block_by_hand");
    {
        /* The element of largest magnitude is -8 (index 3): d = -8 / -8 = 1, id = 1, code = (int)(x + 8.5). */
        float x[32] = {0};
        uint8_t c[32];
        x[0] = 7.4f;   /* 15.9 -> 15 */
        x[1] = 0.49f;  /* 8.99 -> 8 */
        x[2] = 0.5f;   /* 9.0 -> 9: a half rounds up */
        x[3] = -8.0f;  /* 0.5 -> 0 */
        x[4] = -0.51f; /* 7.99 -> 7 */
        kvq_qparams p = quant(KVQ_FMT_Q4_0, 4, 1, x, 32, c);
        TH_CHECK(p.scale == 1.0f && p.zero == 0.0f, "q4_0 d %g", p.scale);
        TH_CHECK(c[0] == 15 && c[1] == 8 && c[2] == 9 && c[3] == 0 && c[4] == 7 && c[5] == 8, "q4_0 codes %d %d %d %d %d %d",
                 c[0], c[1], c[2], c[3], c[4], c[5]);
        /* The largest magnitude positive: d = -1, so +8 -> code 0 (level -8 * -1) and -8 clips to 15 (ggml's
         * asymmetry: -8 comes back as -7). */
        x[3] = 8.0f;
        x[6] = -8.0f;
        p = quant(KVQ_FMT_Q4_0, 4, 1, x, 32, c);
        TH_CHECK(p.scale == -1.0f && c[3] == 0 && c[6] == 15, "q4_0 negative d: %g %d %d", p.scale, c[3], c[6]);
        float lv[32];
        kvq_format_cfg f = fmt(KVQ_FMT_Q4_0);
        kvq_format_levels(&f, 4, lv);
        TH_CHECK(kvq_format_dequant(lv[c[3]], p, 1) == 8.0f && kvq_format_dequant(lv[c[6]], p, 1) == -7.0f, "q4_0 dequant");
        /* q5_0: d = -16 / -16 = 1, code = (int)(x + 16.5), at most 31. */
        memset(x, 0, sizeof x);
        x[0] = -16.0f;
        x[1] = 15.7f; /* 32.2 -> 31 */
        x[2] = -0.5f; /* 16.0 -> 16 */
        p = quant(KVQ_FMT_Q5_0, 5, 1, x, 32, c);
        TH_CHECK(p.scale == 1.0f && c[0] == 0 && c[1] == 31 && c[2] == 16 && c[3] == 16, "q5_0 %g %d %d %d", p.scale,
                 c[0], c[1], c[2]);
    }
    th_end();

    th_begin("formats.q4_1_q5_1_q8_0_block_by_hand");
    {
        float x[32];
        uint8_t c[32];
        /* min -1, max 14: d = 15 / 15 = 1, code = (int)((x + 1) * 1 + 0.5). */
        for (int i = 0; i < 32; i++) x[i] = (float)(i % 16) - 1.0f;
        x[5] = 2.49f; /* 3.99 -> 3 */
        x[6] = 2.5f;  /* 4.0 -> 4 */
        kvq_qparams p = quant(KVQ_FMT_Q4_1, 4, 1, x, 32, c);
        TH_CHECK(p.scale == 1.0f && p.zero == -1.0f, "q4_1 d %g m %g", p.scale, p.zero);
        TH_CHECK(c[0] == 0 && c[15] == 15 && c[5] == 3 && c[6] == 4 && c[20] == 4, "q4_1 codes");
        /* q5_1: min -1, max 30: d = 31 / 31 = 1. */
        for (int i = 0; i < 32; i++) x[i] = (float)i - 1.0f;
        p = quant(KVQ_FMT_Q5_1, 5, 1, x, 32, c);
        TH_CHECK(p.scale == 1.0f && p.zero == -1.0f && c[0] == 0 && c[31] == 31 && c[17] == 17, "q5_1");
        /* q8_0: amax 127 -> d = 1; roundf: half away from zero (2.5 -> 3, -2.5 -> -3). */
        memset(x, 0, sizeof x);
        x[0] = 127.0f;
        x[1] = 2.5f;
        x[2] = -2.5f;
        x[3] = 0.49f;
        p = quant(KVQ_FMT_Q8_0, 8, 1, x, 32, c);
        TH_CHECK(p.scale == 1.0f && c[0] == 255 && c[1] == 131 && c[2] == 125 && c[3] == 128 && c[4] == 128, "q8_0 %d %d %d",
                 c[1], c[2], c[3]);
        /* d is computed in fp32 and stored in fp16: amax 100 gives d = 100/127 -> fp16 0.7876 (0x3a4d). */
        x[0] = 100.0f;
        p = quant(KVQ_FMT_Q8_0, 8, 1, x, 32, c);
        TH_CHECK(kvq_f16_from_f32(p.scale) == kvq_f16_from_f32(100.0f / 127.0f) && c[0] == 255, "q8_0 d fp16");
        /* An all-zero block: d = 0, id = 0, every code the zero level. */
        memset(x, 0, sizeof x);
        p = quant(KVQ_FMT_Q4_0, 4, 1, x, 32, c);
        TH_CHECK(p.scale == 0.0f && c[0] == 8 && c[31] == 8, "q4_0 zero block");
        p = quant(KVQ_FMT_Q4_1, 4, 1, x, 32, c);
        TH_CHECK(p.scale == 0.0f && p.zero == 0.0f && c[0] == 0, "q4_1 zero block");
    }
    th_end();

    th_begin("formats.mxfp4_nvfp4_fp8_by_hand");
    {
        float x[32] = {0};
        uint8_t c[32];
        /* MXFP4: amax 5 -> floor(log2 5) - 2 = 0: scale 2^0 (e8m0 127); 5 -> 4 (tie to even), 7.9 clips to 6. */
        x[0] = 5.0f;
        x[1] = -0.75f;
        kvq_qparams p = quant(KVQ_FMT_MXFP4, 4, 1, x, 32, c);
        TH_CHECK(p.scale == 1.0f && c[0] == 6 && c[1] == 10, "mxfp4 %g %d %d", p.scale, c[0], c[1]);
        TH_CHECK(kvq_format_scale8_encode(KVQ_FMT_MXFP4, p.scale) == 127, "mxfp4 e8m0 code");
        x[0] = 7.9f;
        p = quant(KVQ_FMT_MXFP4, 4, 1, x, 32, c);
        TH_CHECK(p.scale == 1.0f && c[0] == 7, "mxfp4 saturates: %g %d", p.scale, c[0]);
        /* amax 0.3: floor(log2 0.3) = -2, scale 2^-4: 0.3 * 16 = 4.8 -> 4 (code 6). */
        x[0] = 0.3f;
        x[1] = 0.0f;
        p = quant(KVQ_FMT_MXFP4, 4, 1, x, 32, c);
        TH_CHECK(p.scale == 0.0625f && c[0] == 6, "mxfp4 small: %g %d", p.scale, c[0]);
        /* NVFP4 with T = 0.5: amax 3 -> s = e4m3((3 / 6) / 0.5) = 1, step s * T = 0.5: 3 -> 6 (7), -1.25 -> -2.5
         * -> -2 (tie to even, code 12). */
        memset(x, 0, sizeof x);
        x[0] = 3.0f;
        x[1] = -1.25f;
        p = quant(KVQ_FMT_NVFP4, 4, 0.5f, x, 16, c);
        TH_CHECK(p.scale == 1.0f && c[0] == 7 && c[1] == 12, "nvfp4 %g %d %d", p.scale, c[0], c[1]);
        /* The block scale itself rounds in e4m3: amax 6.6 -> 1.1 -> e4m3 1.125. */
        x[0] = 6.6f;
        p = quant(KVQ_FMT_NVFP4, 4, 1.0f, x, 16, c);
        TH_CHECK(p.scale == 1.125f && kvq_format_scale8_encode(KVQ_FMT_NVFP4, p.scale) == 0x39, "nvfp4 e4m3 scale %g",
                 p.scale);
        TH_CHECK(kvq_format_tensor_scale(KVQ_FMT_NVFP4, 2688.0f) == 1.0f &&
                     kvq_format_tensor_scale(KVQ_FMT_E4M3, 224.0f) == 0.5f && kvq_format_tensor_scale(KVQ_FMT_E4M3, 0) == 1.0f,
                 "tensor scales");
        /* e4m3 with T = 2: 3 -> 1.5 (0x3c); e5m2: 3 -> 1.5 (0x3e). */
        x[0] = 3.0f;
        quant(KVQ_FMT_E4M3, 8, 2.0f, x, 1, c);
        TH_CHECK(c[0] == 0x3c, "e4m3 element %#x", c[0]);
        quant(KVQ_FMT_E5M2, 8, 2.0f, x, 1, c);
        TH_CHECK(c[0] == 0x3e, "e5m2 element %#x", c[0]);
    }
    th_end();

    th_begin("formats.int_symmetric_and_codebooks");
    {
        float x[8] = {7.0f, 2.5f, -7.0f, 3.5f, -0.4f, 0, 1, -1}, lv[256];
        uint8_t c[8];
        /* 4-bit symmetric: s = 7 / 7 = 1; rint (2.5 -> 2, 3.5 -> 4); code = q + 8. */
        kvq_qparams p = quant(KVQ_FMT_INT_SYM, 4, 1, x, 8, c);
        TH_CHECK(p.scale == 1.0f && c[0] == 15 && c[1] == 10 && c[2] == 1 && c[3] == 12 && c[4] == 8, "int sym");
        kvq_format_cfg f = fmt(KVQ_FMT_INT_SYM);
        kvq_format_levels(&f, 4, lv);
        TH_CHECK(lv[8] == 0.0f && lv[15] == 7.0f && lv[0] == -8.0f, "int sym levels");
        /* Explicit codebook {-1, -0.25, 0.25, 1}, absmax 2 -> s = 2: 0.25 -> 0.125 -> level 0.25 (code 2); 1.25 ->
         * 0.625, as near 0.25 as 1: the lower code (2). */
        f = fmt(KVQ_FMT_CODEBOOK);
        f.n_levels = 4;
        f.levels[0] = -1;
        f.levels[1] = -0.25f;
        f.levels[2] = 0.25f;
        f.levels[3] = 1;
        float y[4] = {2.0f, 0.25f, 1.25f, -2.0f};
        p = kvq_format_quantize_group(&f, 2, KVQ_DT_FP16, KVQ_DT_FP16, 1, y, 4, 1, c);
        TH_CHECK(p.scale == 2.0f && c[0] == 3 && c[1] == 2 && c[2] == 2 && c[3] == 0, "codebook %g %d %d %d %d", p.scale,
                 c[0], c[1], c[2], c[3]);
        /* A codebook of 3 levels at 2 bits: code 3 is unused and decodes to 0. */
        f.n_levels = 3;
        kvq_format_levels(&f, 2, lv);
        TH_CHECK(lv[2] == 0.25f && lv[3] == 0.0f, "short codebook");
        /* normal, 1 bit: levels +-0.798; the group's rms is 1. */
        double d[2];
        kvq_lloyd_max_normal(1, 1.0, d, NULL);
        f = fmt(KVQ_FMT_CODEBOOK);
        f.codebook_normal = 1;
        f.n_levels = 2;
        f.levels[0] = (float)d[0];
        f.levels[1] = (float)d[1];
        float z[4] = {1, -1, 1, -1};
        p = kvq_format_quantize_group(&f, 1, KVQ_DT_FP16, KVQ_DT_FP16, 1, z, 4, 1, c);
        TH_CHECK(p.scale == 1.0f && c[0] == 1 && c[1] == 0, "normal codebook");
    }
    th_end();

    th_begin("formats.five_bit_packing");
    {
        uint8_t codes[128], back[128], packed[80];
        for (int i = 0; i < 128; i++) codes[i] = (uint8_t)((i * 7 + 3) % 32);
        kvq_pack_codes(codes, 128, 5, packed);
        kvq_unpack_codes(packed, 128, 5, back);
        TH_CHECK(memcmp(codes, back, 128) == 0, "round trip");
        /* Low nibbles first (channel 0 in bits 0-3 of byte 0), then the fifth bits from byte D/2. */
        TH_CHECK(packed[0] == (uint8_t)((codes[0] & 15) | (codes[1] & 15) << 4), "nibble plane byte 0: %#x", packed[0]);
        uint8_t hb = 0;
        for (int i = 0; i < 8; i++) hb |= (uint8_t)((codes[i] >> 4) << i);
        TH_CHECK(packed[64] == hb, "high plane byte 0: %#x, want %#x", packed[64], hb);
        TH_CHECK(kvq_format_code_bits(&(kvq_format_cfg){.kind = KVQ_FMT_Q5_1}, 16) == 5, "q5 code bits");
    }
    th_end();
    return th_summary();
}
