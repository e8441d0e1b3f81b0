/* The quantizer (runtime/quant.h) and the page layout (layout/layout.h): properties and hand-worked cases. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "harness.h"
#include "half.h"
#include "layout.h"
#include "quant.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double urand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}

/* Every element within half a step of its input, for every bit-width and parameter dtype, on groups of fp16
 * values of random range and offset (K/V arrive as fp16). */
static void test_half_step_bound(void)
{
    static const int bits[] = {1, 2, 3, 4, 8};
    for (int bi = 0; bi < 5; bi++) {
        for (int dt = 0; dt < 2; dt++) {
            th_begin("quant: |x - x'| <= s/2 at %d bits, %s params", bits[bi], dt ? "fp32" : "fp16");
            double worst = 0;
            for (int trial = 0; trial < 2000 && !th_failed(); trial++) {
                float x[64];
                uint8_t codes[64];
                double mag = pow(10.0, urand() * 6 - 3), off = (urand() - 0.5) * 4 * mag;
                int n = 1 + (int)(urand() * 64);
                for (int i = 0; i < n; i++) x[i] = kvq_f16_round((float)(off + (urand() - 0.5) * mag));
                kvq_qparams p = kvq_quantize_group(x, (size_t)n, 1, bits[bi], (kvq_param_dtype)dt,
                                                   (kvq_param_dtype)dt, codes);
                TH_CHECK(p.scale >= 0 && isfinite(p.scale), "scale %g", p.scale);
                TH_CHECK(kvq_param_round(p.scale, (kvq_param_dtype)dt) == p.scale, "scale not representable");
                TH_CHECK(kvq_param_round(p.zero, (kvq_param_dtype)dt) == p.zero, "zero not representable");
                for (int i = 0; i < n; i++) {
                    TH_CHECK(codes[i] < (1u << bits[bi]), "code %u out of range", codes[i]);
                    float r = kvq_dequant(codes[i], p);
                    double err = fabs((double)r - (double)x[i]);
                    /* fp32 rounding of z + s*code adds at most an ulp of the larger operand. */
                    double tol = p.scale / 2 + 2 * (fabs(p.zero) + p.scale * ((1 << bits[bi]) - 1)) * 0x1p-24;
                    if (err / (p.scale > 0 ? p.scale : 1) > worst) worst = err / (p.scale > 0 ? p.scale : 1);
                    TH_CHECK(err <= tol, "x=%.9g x'=%.9g s=%.9g z=%.9g code=%u", x[i], r, p.scale, p.zero,
                             codes[i]);
                }
            }
            th_end();
        }
    }
}

static void test_constant_and_one_bit(void)
{
    th_begin("quant: a constant group gets s = 0 and reconstructs exactly");
    float x[8] = {0.1f, 0.1f, 0.1f, 0.1f, 0.1f, 0.1f, 0.1f, 0.1f};
    for (int i = 0; i < 8; i++) x[i] = kvq_f16_round(x[i]);
    uint8_t c[8];
    kvq_qparams p = kvq_quantize_group(x, 8, 1, 2, KVQ_DT_FP16, KVQ_DT_FP16, c);
    TH_CHECK(p.scale == 0.0f, "scale %g", p.scale);
    for (int i = 0; i < 8; i++) TH_CHECK(c[i] == 0 && kvq_dequant(c[i], p) == x[i], "element %d", i);
    th_end();

    /* DESIGN §4: 1-bit is the same formula with one level; each element becomes its group's min or max.
     * Hand-worked: group {-1, -0.25, 0.25, 2} -> z = -1, s = 3, codes by rint((x+1)/3): 0, 0, 0, 1. */
    th_begin("quant: hand-worked 1-bit group");
    float y[4] = {-1.0f, -0.25f, 0.25f, 2.0f};
    p = kvq_quantize_group(y, 4, 1, 1, KVQ_DT_FP16, KVQ_DT_FP16, c);
    TH_CHECK(p.zero == -1.0f && p.scale == 3.0f, "z=%g s=%g", p.zero, p.scale);
    TH_CHECK(c[0] == 0 && c[1] == 0 && c[2] == 0 && c[3] == 1, "codes %u %u %u %u", c[0], c[1], c[2], c[3]);
    TH_CHECK(kvq_dequant(c[3], p) == 2.0f && kvq_dequant(c[1], p) == -1.0f, "reconstruction");
    th_end();

    /* Hand-worked 2-bit group: {0, 1, 2, 3.5}: z = 0, s = 3.5/3 rounded up to fp16 = 1.16699..., codes by
     * rint(x/s): 0, rint(0.857)=1, rint(1.714)=2, rint(2.999)=3. Halves round to even: x = 1.5*s -> 2. */
    th_begin("quant: hand-worked 2-bit group, fp16 scale rounded up, ties to even");
    float w[4] = {0.0f, 1.0f, 2.0f, 3.5f};
    p = kvq_quantize_group(w, 4, 1, 2, KVQ_DT_FP16, KVQ_DT_FP16, c);
    TH_CHECK(p.zero == 0.0f, "z=%g", p.zero);
    TH_CHECK(p.scale >= 3.5f / 3 && p.scale == kvq_f16_round(p.scale) && p.scale < 3.5f / 3 + 0.001f, "s=%.9g",
             p.scale);
    TH_CHECK(c[0] == 0 && c[1] == 1 && c[2] == 2 && c[3] == 3, "codes %u %u %u %u", c[0], c[1], c[2], c[3]);
    kvq_qparams q = {2.0f, 0.0f};
    TH_CHECK(kvq_quant_code(3.0f, q, 2) == 2 && kvq_quant_code(1.0f, q, 2) == 0 && kvq_quant_code(5.0f, q, 2) == 2,
             "ties to even");
    TH_CHECK(kvq_quant_code(-7.0f, q, 2) == 0 && kvq_quant_code(100.0f, q, 2) == 3 && kvq_quant_code(NAN, q, 2) == 0,
             "clamping");
    th_end();
}

/* Bit order is part of the layout contract: check exact bytes, then round trips. */
static void test_packing(void)
{
    th_begin("pack: explicit bit order for 2-bit and 3-bit codes");
    uint8_t codes[32], out[32], back[32];
    for (int i = 0; i < 32; i++) codes[i] = (uint8_t)(i % 4);
    kvq_pack_codes(codes, 32, 2, out);
    /* Channel c at bits 2c of word 0 (c < 16): codes 0,1,2,3 repeating -> each byte 0b11100100 = 0xe4. */
    for (int i = 0; i < 8; i++) TH_CHECK(out[i] == 0xe4, "byte %d = %#x", i, out[i]);
    for (int i = 0; i < 32; i++) codes[i] = (uint8_t)(i == 1 ? 7 : i == 2 ? 4 : i == 31 ? 3 : 0);
    kvq_pack_codes(codes, 32, 3, out);
    /* Low plane: channel 1 -> bits 2-3 = 3; channel 2 -> 0; channel 31 -> bits 62-63 (byte 7, bits 6-7) = 3. */
    TH_CHECK(out[0] == 0x0c && out[7] == 0xc0, "low plane %#x %#x", out[0], out[7]);
    /* High plane (after D/4 = 8 bytes): channels 1 and 2 have bit 2 set -> byte 8 = 0b110. */
    TH_CHECK(out[8] == 0x06 && out[9] == 0 && out[11] == 0, "high plane %#x", out[8]);
    th_end();

    static const int bits[] = {1, 2, 3, 4, 8};
    static const int dims[] = {64, 96, 128, 256};
    for (int bi = 0; bi < 5; bi++) {
        th_begin("pack: round trip at %d bits for head_dim 64..256", bits[bi]);
        for (int di = 0; di < 4; di++) {
            uint8_t c[256], p[512], u[256];
            int D = dims[di];
            for (int i = 0; i < D; i++) c[i] = (uint8_t)(urand() * (1 << bits[bi]));
            memset(p, 0xAA, sizeof p);
            kvq_pack_codes(c, D, bits[bi], p);
            size_t nb = kvq_code_bytes(D, bits[bi]);
            TH_CHECK(p[nb] == 0xAA, "packing wrote past %zu bytes", nb);
            kvq_unpack_codes(p, D, bits[bi], u);
            TH_CHECK(memcmp(c, u, (size_t)D) == 0, "head_dim %d differs", D);
        }
        th_end();
    }
    (void)back;
}

static void test_param_rounding(void)
{
    th_begin("quant: parameter rounding down/up brackets the value in fp16");
    for (int i = 0; i < 20000 && !th_failed(); i++) {
        float x = (float)((urand() - 0.5) * pow(10.0, urand() * 8 - 5));
        float d = kvq_param_round_down(x, KVQ_DT_FP16), u = kvq_param_round_up(x, KVQ_DT_FP16);
        TH_CHECK(d <= x && u >= x, "x=%.9g d=%.9g u=%.9g", x, d, u);
        TH_CHECK(kvq_f16_round(d) == d && kvq_f16_round(u) == u, "not representable");
        /* Adjacent: no fp16 strictly between d and u other than x itself. */
        TH_CHECK(d == u || kvq_f16_from_f32(u) - kvq_f16_from_f32(d) == 1 ||
                     kvq_f16_from_f32(d) - kvq_f16_from_f32(u) == 1 || (d <= 0 && u >= 0),
                 "not neighbours: %g %g", d, u);
    }
    th_end();
}

static void test_layout_sizes(void)
{
    th_begin("layout: page sections are 16-byte aligned and sized by the format");
    kvq_tensor_cfg key = {.bits = 2, .gran = KVQ_GRAN_CHANNEL, .channel_separable = 0, .group = 32,
                          .scale_dtype = KVQ_DT_FP16, .zero_dtype = KVQ_DT_FP16};
    kvq_page_format f;
    kvq_page_layout l;
    kvq_page_format_init(&f, &key, 2, 1, 8, 128, 32);
    kvq_page_layout_compute(&f, &l);
    /* 8 heads x 32 tokens x 128 ch x 2 bits = 8192 B; scale and zero 8x128 fp16 = 2048 B each; mask 8 x 4 B. */
    TH_CHECK(l.codes_size == 8192 && l.scale_size == 2048 && l.zero_size == 2048, "sizes %zu %zu %zu",
             l.codes_size, l.scale_size, l.zero_size);
    TH_CHECK(l.mask_size == 32 && l.total == 8192 + 4096 + 32, "mask %zu total %zu", l.mask_size, l.total);
    kvq_tensor_cfg val = {.bits = 3, .gran = KVQ_GRAN_TOKEN, .channel_separable = 1, .group = 32,
                          .scale_dtype = KVQ_DT_FP32, .zero_dtype = KVQ_DT_FP16};
    kvq_page_format_init(&f, &val, 3, 0, 2, 96, 5);
    kvq_page_layout_compute(&f, &l);
    /* codes 2 x 5 x 36 = 360 -> 368; scale fp32 2x5x3 = 120 -> 128; zero fp16 60 -> 64; factor fp32 2x96 = 768. */
    TH_CHECK(l.codes_size == 368 && l.scale_size == 128 && l.zero_size == 64 && l.factor_size == 768,
             "sizes %zu %zu %zu %zu", l.codes_size, l.scale_size, l.zero_size, l.factor_size);
    TH_CHECK(l.codes % 16 == 0 && l.scale % 16 == 0 && l.zero % 16 == 0 && l.factor % 16 == 0, "alignment");
    th_end();
}

/* KIVI Alg. 1 prefill split: keys leave l mod R in the window, values the last R. */
static void test_window_rules(void)
{
    th_begin("layout: KIVI and OTT window rules split a prefill as the papers do");
    kvq_quant_cfg q;
    memset(&q, 0, sizeof q);
    q.key = (kvq_tensor_cfg){.bits = 2, .gran = KVQ_GRAN_CHANNEL, .group = 32};
    q.value = (kvq_tensor_cfg){.bits = 2, .gran = KVQ_GRAN_TOKEN, .group = 32};
    q.residual = 128;
    kvq_window_rule rk, rv;
    kvq_window_rule_of(&q, 0, &rk);
    kvq_window_rule_of(&q, 1, &rv);
    TH_CHECK(kvq_window_prefill_quantized(&rk, 1000) == 896 && rk.capacity == 128, "keys %d",
             kvq_window_prefill_quantized(&rk, 1000));
    TH_CHECK(kvq_window_prefill_quantized(&rv, 1000) == 872 && rv.capacity == 129, "values %d",
             kvq_window_prefill_quantized(&rv, 1000));
    TH_CHECK(kvq_window_prefill_quantized(&rk, 100) == 0 && kvq_window_prefill_quantized(&rv, 100) == 0, "short");
    q.flush = KVQ_FLUSH_GROUP;
    q.residual = 32;
    q.key.group = 128;
    kvq_window_rule_of(&q, 0, &rk);
    kvq_window_rule_of(&q, 1, &rv);
    /* OTT: keep 32 newest, quantize G = 128 at a time: 1000 -> 896 quantized (1000-32 = 968 -> 7 groups). */
    TH_CHECK(kvq_window_prefill_quantized(&rk, 1000) == 896 && kvq_window_prefill_quantized(&rv, 1000) == 896 &&
                 rk.capacity == 160,
             "ott %d", kvq_window_prefill_quantized(&rk, 1000));
    th_end();
}

int main(void)
{
    test_half_step_bound();
    test_constant_and_one_bit();
    test_packing();
    test_param_rounding();
    test_layout_sizes();
    test_window_rules();
    return th_summary();
}
