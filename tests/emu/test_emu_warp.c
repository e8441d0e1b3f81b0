/* Emulator: warp collectives against values computed here lane by lane: butterfly and down-sweep reductions,
 * scans, broadcasts, segments of every width with CUDA's rules for sources outside a segment, votes, matches,
 * __reduce_*_sync, 64-bit and floating-point shuffles, half-warp masks, __syncwarp, partial warps, and the
 * shuffled scheduling mode. */
#include <stdlib.h>

#include "emu_test.h"
#include "params.h"

EMU_KERNEL_DECLARE(warp_ops);
EMU_KERNEL_DECLARE(warp_float);

/* Expected outputs of warp_ops for lane l of a warp whose values are v[0..lanes). */
static void expect(const unsigned *v, unsigned lanes, unsigned l, unsigned w, unsigned *o)
{
    unsigned valid = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1, sum = 0, ballot = 0, any = 0, all = 1;
    unsigned same = 0, umax = 0, all_small = 1;
    int imin = 0x7fffffff;
    memset(o, 0, WARP_OUTS * sizeof *o);
    for (unsigned i = 0; i < lanes; i++) {
        sum += v[i];
        ballot |= (v[i] & 1) << i;
        any |= v[i] == 7;
        all &= v[i] < 1000;
        same |= (unsigned)(v[i] % 4 == v[l] % 4) << i;
        umax = v[i] > umax ? v[i] : umax;
        imin = (int)v[i] - 500 < imin ? (int)v[i] - 500 : imin;
        all_small &= v[i] / 1000 == v[0] / 1000;
    }
    o[7] = ballot;
    o[8] = any | all << 1;
    o[9] = same;
    o[10] = sum;
    o[18] = (unsigned)imin;
    o[19] = umax;
    o[20] = all_small ? valid ^ 1u << 31 : 0;
    if (lanes < 32) return;
    unsigned seg = l - l % w, seg_sum = 0, scan = 0, seg_scan = 0;
    for (unsigned i = 0; i <= l; i++) scan += v[i];
    for (unsigned i = seg; i < seg + w; i++) seg_sum += v[i];
    for (unsigned i = seg; i <= l; i++) seg_scan += v[i];
    o[0] = sum;
    o[1] = scan;
    o[2] = l == 0 ? sum : 0;
    o[3] = v[5];
    o[4] = v[seg];
    o[5] = seg_sum;
    o[6] = seg_scan;
    o[11] = v[l ^ 1] ^ (l ^ 1) << 16;
    o[12] = v[l < 16 ? 0 : 16];
    o[13] = v[l ^ 1];
    o[14] = w < 32 && (l & w) ? v[l ^ w] : v[l];       /* earlier segment readable, later one not */
    o[15] = l % w + 3 < w ? v[l + 3] : v[l];           /* past the segment's end: own value */
    o[16] = l % w >= 3 ? v[l - 3] : v[l];              /* before the segment's start: own value */
    o[17] = v[seg + (w + 1) % w];                      /* source lane taken modulo the width */
}

static void run(unsigned nt, unsigned width, uint64_t shuffle_seed)
{
    th_begin("emu warp collectives, block %u, width %u%s", nt, width, shuffle_seed ? ", shuffled" : "");
    unsigned *in = malloc(nt * sizeof *in), *out = malloc((size_t)nt * WARP_OUTS * sizeof *out), want[WARP_OUTS];
    uint64_t seed = nt * 31 + width;
    for (unsigned i = 0; i < nt; i++) in[i] = test_rand(&seed) % (i / 32 % 2 ? 900 : 5000);
    struct warp_params p = {in, out, (int)width};
    struct emu_options opt = {.shuffle_seed = shuffle_seed, .stack_size = 0, .stats = NULL};
    LAUNCH_OK(EMU_KERNEL(warp_ops), d3(1, 1, 1), d3(nt, 1, 1), 0, &p, &opt);
    for (unsigned t = 0; t < nt && !th_failed(); t++) {
        unsigned base = t - t % 32, lanes = nt - base >= 32 ? 32 : nt - base;
        expect(in + base, lanes, t % 32, width, want);
        for (unsigned k = 0; k < WARP_OUTS; k++)
            TH_CHECK(out[t * WARP_OUTS + k] == want[k], "thread %u output %u: 0x%08x, want 0x%08x", t, k,
                     out[t * WARP_OUTS + k], want[k]);
    }
    free(in);
    free(out);
    th_end();
}

static void run_float(void)
{
    th_begin("emu float and double shuffles");
    unsigned nt = 64, in[64], out[128];
    for (unsigned i = 0; i < nt; i++) in[i] = i * 4;
    struct warp_params p = {in, out, 32};
    LAUNCH_OK(EMU_KERNEL(warp_float), d3(1, 1, 1), d3(nt, 1, 1), 0, &p, NULL);
    for (unsigned t = 0; t < nt && !th_failed(); t++) {
        unsigned s = 0;
        for (unsigned i = t - t % 32; i < t - t % 32 + 32; i++) s += in[i];
        TH_CHECK(out[2 * t] == s / 2 && out[2 * t + 1] == s / 4, "thread %u: %u %u, want %u %u", t, out[2 * t],
                 out[2 * t + 1], s / 2, s / 4);
    }
    th_end();
}

int main(void)
{
    static const unsigned widths[] = {1, 2, 8, 16, 32};
    for (unsigned i = 0; i < sizeof widths / sizeof *widths; i++) run(96, widths[i], 0);
    run(64, 4, 0);
    run(1024, 16, 0);
    run(48, 8, 0);  /* second warp half full */
    run(7, 32, 0);  /* one partial warp */
    run(96, 8, 12345);
    run(1000, 32, 777);
    run_float();
    emu_release();
    return th_summary();
}
