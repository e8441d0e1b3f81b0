/* The decode kernel's code unpacking (templates/kvq_unpack.cuh) under the emulator: for each 1, 2 and 4-bit row
 * and each run of 8 channels, the plain unpacking, the pre-shifted one and its 2^-k factors, one run per thread
 * (no barriers). */
#define KVQ_D 128
#define KVQ_IN_DTYPE 0
#include "kvq_unpack.cuh"
#include "params.h"

extern "C" __global__ void unpack_runs(const struct unpack_params p)
{
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= p.n_rows * (KVQ_D / 8)) return;
    const int row = i / (KVQ_D / 8), c0 = (i % (KVQ_D / 8)) * 8;
    const unsigned char *r = (const unsigned char *)(p.rows + row * (KVQ_D / 32) * 4);
    float plain[8], ps[8];
    kvq_unpack8(r, c0, p.bits, KVQ_D, plain);
    kvq_unpack8_ps(r, c0, p.bits, ps);
    for (int v = 0; v < 8; v++) {
        p.plain[i * 8 + v] = plain[v];
        p.shifted[i * 8 + v] = ps[v];
        p.inv[i * 8 + v] = kvq_preshift_inv(p.bits, c0 + v);
    }
}
KVQ_KERNEL_EXPORT(unpack_runs);
