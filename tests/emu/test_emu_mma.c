/* Emulator: kvq_mma_m16n8k16 (mma.sync.m16n8k16.row.col.f32.f16.f16.f32) against a plain matrix product. The
 * kernel (kernels/mma.cu) builds every lane's fragments by the PTX ISA's layout, so a lane or register mapped to
 * the wrong row or column changes D. D must equal, bit for bit, C plus the exact products added one at a time
 * in fp32 with k ascending (the emulator's documented order), and lie within the fp32 accumulation bound of the
 * exact (double) result, which is what the decode kernel's accuracy argument uses (docs/cuda.md). Operands are
 * fp16 with exponents from 2^-24 (subnormal) to 2^14, signs mixed, and small integers like the decode kernel's
 * codes. The NVRTC test compiles the same kernel for sm_80 and sm_90. */
#include <math.h>
#include <stdlib.h>

#include "emu_half.h"
#include "emu_test.h"
#include "params.h"

EMU_KERNEL_DECLARE(mma_two);

enum { WARPS = 4 };

static unsigned short rand_half(uint64_t *seed, int kind)
{
    if (kind == 0) return emu_f2h_rn((float)(test_rand(seed) % 16)); /* a code */
    int e = (int)(test_rand(seed) % 39) - 24;                          /* 2^-24 .. 2^14 */
    float x = ldexpf(1.0f + (float)(test_rand(seed) % 1024) / 1024.0f, e);
    if (test_rand(seed) & 1) x = -x;
    return emu_f2h_rn(x);
}

int main(void)
{
    th_begin("emu mma.sync.m16n8k16: fragment layout and accumulation against a plain matrix product");
    unsigned short *a = malloc(WARPS * 2 * 256 * sizeof *a), *b = malloc(WARPS * 2 * 128 * sizeof *b);
    float *c = malloc(WARPS * 128 * sizeof *c), *d = malloc(WARPS * 128 * sizeof *d);
    uint64_t seed = 4242;
    for (int i = 0; i < WARPS * 2 * 256; i++) a[i] = rand_half(&seed, (i / 512) % 2 == 0);
    for (int i = 0; i < WARPS * 2 * 128; i++) b[i] = rand_half(&seed, 1);
    for (int i = 0; i < WARPS * 128; i++) c[i] = (float)((int)(test_rand(&seed) % 2001) - 1000) / 64.0f;
    struct mma_params p = {a, b, c, d};
    LAUNCH_OK(EMU_KERNEL(mma_two), d3(2, 1, 1), d3(64, 1, 1), 0, &p, NULL);
    for (int w = 0; w < WARPS && !th_failed(); w++)
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 8; j++) {
                float acc = c[w * 128 + i * 8 + j];
                double exact = acc, mag = fabs(acc);
                for (int s = 0; s < 2; s++)
                    for (int k = 0; k < 16; k++) {
                        double x = (double)emu_h2f(a[(w * 2 + s) * 256 + i * 16 + k]);
                        double y = (double)emu_h2f(b[(w * 2 + s) * 128 + k * 8 + j]);
                        float prod = (float)(x * y); /* exact: 22 significant bits */
                        acc = acc + prod;
                        exact += x * y, mag += fabs(x * y);
                    }
                float got = d[w * 128 + i * 8 + j];
                TH_CHECK(got == acc, "warp %d D[%d][%d] = %.9g, want %.9g (C + products in k order)", w, i, j, got, acc);
                TH_CHECK(fabs(got - exact) <= 33 * 0x1p-24 * mag, "warp %d D[%d][%d] = %.9g, exact %.17g", w, i, j,
                         got, exact);
            }
    free(a), free(b), free(c), free(d);
    th_end();
    emu_release();
    return th_summary();
}
