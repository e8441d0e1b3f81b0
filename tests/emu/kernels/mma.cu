/* kvq_mma_m16n8k16 for the emulator's test: each warp builds its lanes' fragments from row-major matrices in
 * global memory by the PTX ISA's layout for mma.m16n8k16 (f16 A row-major, B column-major, f32 C/D), runs two
 * products into one accumulator (D = C + A0 B0 + A1 B1: the in-place accumulation the decode kernel relies on)
 * and writes D back row-major. test_emu_mma.c checks D against a plain matrix product. */
#include "kvq_intrin.cuh"
#include "params.h"

static __device__ unsigned mma_pair(const unsigned short *m, int stride, int r0, int c0, int r1, int c1)
{
    return (unsigned)m[r0 * stride + c0] | (unsigned)m[r1 * stride + c1] << 16;
}

extern "C" __global__ void mma_two(const struct mma_params p)
{
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    float acc[4];
    const float *c = p.c + warp * 128;
    acc[0] = c[g * 8 + 2 * t], acc[1] = c[g * 8 + 2 * t + 1];
    acc[2] = c[(g + 8) * 8 + 2 * t], acc[3] = c[(g + 8) * 8 + 2 * t + 1];
    for (int s = 0; s < 2; s++) {
        const unsigned short *A = p.a + (warp * 2 + s) * 256, *B = p.b + (warp * 2 + s) * 128;
        unsigned a[4], b[2];
        a[0] = mma_pair(A, 16, g, 2 * t, g, 2 * t + 1);
        a[1] = mma_pair(A, 16, g + 8, 2 * t, g + 8, 2 * t + 1);
        a[2] = mma_pair(A, 16, g, 2 * t + 8, g, 2 * t + 9);
        a[3] = mma_pair(A, 16, g + 8, 2 * t + 8, g + 8, 2 * t + 9);
        b[0] = mma_pair(B, 8, 2 * t, g, 2 * t + 1, g);
        b[1] = mma_pair(B, 8, 2 * t + 8, g, 2 * t + 9, g);
        kvq_mma_m16n8k16(acc, a, b);
    }
    float *d = p.d + warp * 128;
    d[g * 8 + 2 * t] = acc[0], d[g * 8 + 2 * t + 1] = acc[1];
    d[(g + 8) * 8 + 2 * t] = acc[2], d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}
KVQ_KERNEL_EXPORT(mma_two);
