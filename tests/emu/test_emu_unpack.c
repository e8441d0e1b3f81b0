/* Emulator: the decode kernel's unpacking of 1, 2 and 4-bit codes (templates/kvq_unpack.cuh). The plain
 * unpacking gives each code as a float; the pre-shifted one (kvq_unpack8_ps) gives code v of a run of 8 as
 * c 2^k(v) with k = bits v (4 (v mod 4) for 4-bit codes) exactly, and kvq_preshift_inv is 2^-k(v), so that the
 * decode kernel's products with the pre-shifted codes are bit-identical to the plain ones (docs/cuda.md,
 * "Unpacking"). Codes are read back from the packed rows here (layout/layout.h bit order: code c at bit
 * c x bits of the row, little-endian). */
#include <math.h>
#include <stdlib.h>

#include "emu_test.h"
#include "params.h"

EMU_KERNEL_DECLARE(unpack_runs);

enum { D = 128, WORDS = 16 };

int main(void)
{
    th_begin("emu unpack: buffers");
    const int n_rows = 64, n = n_rows * (D / 8) * 8;
    static const int widths[] = {1, 2, 4};
    unsigned *rows = malloc(n_rows * WORDS * sizeof *rows);
    float *plain = malloc(n * sizeof *plain), *shifted = malloc(n * sizeof *shifted), *inv = malloc(n * sizeof *inv);
    uint64_t seed = 4242;
    TH_CHECK(rows && plain && shifted && inv, "out of memory");
    if (!th_end()) return th_summary();
    for (int wi = 0; wi < 3; wi++) {
        const int bits = widths[wi];
        th_begin("emu unpack: %d-bit codes, plain and pre-shifted (c 2^k exact, 2^-k factor)", bits);
        for (int i = 0; i < n_rows * WORDS; i++) rows[i] = test_rand(&seed) ^ test_rand(&seed) << 16;
        rows[0] = 0xffffffffu, rows[WORDS] = 0; /* every code at its largest, and at 0 */
        struct unpack_params p = {rows, plain, shifted, inv, n_rows, bits};
        const unsigned nt = 128, runs = (unsigned)(n_rows * (D / 8));
        LAUNCH_OK(EMU_KERNEL(unpack_runs), d3((runs + nt - 1) / nt, 1, 1), d3(nt, 1, 1), 0, &p, NULL);
        int bad = 0;
        for (int r = 0; r < n_rows && !bad; r++)
            for (int c = 0; c < D && !bad; c++) {
                const int bit = c * bits, v = c & 7, i = r * D + c;
                const unsigned code = (rows[r * WORDS + bit / 32] >> (bit % 32)) & ((1u << bits) - 1u);
                const int k = bits == 4 ? 4 * (v & 3) : bits * v;
                if (plain[i] != (float)code || shifted[i] != ldexpf((float)code, k) || inv[i] != ldexpf(1.0f, -k) ||
                    shifted[i] * inv[i] != plain[i]) {
                    TH_CHECK(0, "%d-bit row %d channel %d: code %u, plain %g, shifted %g (want %g), 2^-k %g", bits,
                             r, c, code, plain[i], shifted[i], ldexpf((float)code, k), inv[i]);
                    bad = 1;
                }
            }
        th_end();
    }
    free(rows), free(plain), free(shifted), free(inv);
    emu_release();
    return th_summary();
}
