/* Emulator: the portable fiber switch (ucontext, used where the hand-written x86-64 switch is not available)
 * runs the same kernels: this program links the runtime built with -DEMU_FIBER_UCONTEXT. */
#include <math.h>
#include <stdlib.h>

#include "emu_test.h"
#include "params.h"

EMU_KERNEL_DECLARE(block_sum);
EMU_KERNEL_DECLARE(block_sum_dyn);
EMU_KERNEL_DECLARE(warp_float);

int main(void)
{
    th_begin("emu ucontext fibers: block reductions, warp shuffles, barrier count");
    int n = 5000;
    unsigned g = 3, nt = 128;
    float *in = malloc((size_t)n * sizeof *in), out[3];
    double want = 0;
    for (int i = 0; i < n; i++) in[i] = (float)(i % 17) - 8.0f, want += in[i];
    struct block_sum_params p = {in, out, n};
    struct emu_stats st;
    struct emu_options opt = {.shuffle_seed = 0, .stack_size = 0, .stats = &st};
    LAUNCH_OK(EMU_KERNEL(block_sum), d3(g, 1, 1), d3(nt, 1, 1), 0, &p, &opt);
    TH_CHECK(out[0] + out[1] + out[2] == (float)want, "static smem sum %g, want %g", out[0] + out[1] + out[2], want);
    TH_CHECK(st.barrier_crossings == (uint64_t)g * nt * 8, "%llu crossings", (unsigned long long)st.barrier_crossings);
    opt.shuffle_seed = 9;
    LAUNCH_OK(EMU_KERNEL(block_sum_dyn), d3(g, 1, 1), d3(nt, 1, 1), nt / 32 * sizeof(float), &p, &opt);
    TH_CHECK(out[0] + out[1] + out[2] == (float)want, "dynamic smem sum %g, want %g", out[0] + out[1] + out[2], want);
    unsigned win[64], wout[128];
    for (unsigned i = 0; i < 64; i++) win[i] = i;
    struct warp_params wp = {win, wout, 32};
    LAUNCH_OK(EMU_KERNEL(warp_float), d3(1, 1, 1), d3(64, 1, 1), 0, &wp, NULL);
    TH_CHECK(wout[0] == 496 / 2 && wout[2 * 63 + 1] == (32 * 32 + 496) / 4, "warp sums %u %u", wout[0], wout[127]);
    free(in);
    th_end();
    emu_release();
    return th_summary();
}
