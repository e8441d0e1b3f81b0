/* Tiled matrix product with cp.async double buffering, for the emulator's tests: while the block multiplies one
 * pair of 16x16 tiles out of shared memory, the next pair is already on its way. Edges are zero-filled by the
 * copies themselves (K and N multiples of 4, so every 16-byte chunk is aligned). */
#include "kvq_intrin.cuh"
#include "params.h"

static __device__ __forceinline__ int clamp4(int v) { return v < 0 ? 0 : v > 4 ? 4 : v; }

/* Threads 0-63 fetch the A tile, 64-127 the B tile, 16 bytes each. */
static __device__ __forceinline__ void load_tiles(const struct matmul_params &p, float (*as)[MM_TILE],
                                                  float (*bs)[MM_TILE], int tile, unsigned tid)
{
    if (tid < 64) {
        int r = (int)tid / 4, c = (int)tid % 4 * 4, row = (int)blockIdx.y * MM_TILE + r, col = tile * MM_TILE + c;
        int n = row < p.m ? clamp4(p.k - col) : 0;
        kvq_cp_async16_zfill(&as[r][c], n ? p.a + (size_t)row * p.k + col : p.a, 4 * n);
    } else if (tid < 128) {
        int i = (int)tid - 64, r = i / 4, c = i % 4 * 4, row = tile * MM_TILE + r, col = (int)blockIdx.x * MM_TILE + c;
        int n = row < p.k ? clamp4(p.n - col) : 0;
        kvq_cp_async16_zfill(&bs[r][c], n ? p.b + (size_t)row * p.n + col : p.b, 4 * n);
    }
}

extern "C" __global__ void matmul_tiled(const struct matmul_params p)
{
    __shared__ __align__(16) float as[2][MM_TILE][MM_TILE];
    __shared__ __align__(16) float bs[2][MM_TILE][MM_TILE];
    unsigned tx = threadIdx.x, ty = threadIdx.y, tid = ty * MM_TILE + tx;
    int tiles = (p.k + MM_TILE - 1) / MM_TILE;
    float acc = 0.0f;
    load_tiles(p, as[0], bs[0], 0, tid);
    kvq_cp_async_commit();
    for (int t = 0; t < tiles; t++) {
        /* bug 3: waits for all but the newest group before the next tile's group exists, so the newest is tile t
         * itself, which wait_group 1 leaves in flight */
        if (p.bug == 3) kvq_cp_async_wait_group(1);
        if (t + 1 < tiles) load_tiles(p, as[(t + 1) & 1], bs[(t + 1) & 1], t + 1, tid);
        kvq_cp_async_commit(); /* possibly empty: keeps "all but the newest group" meaning tile t */
        if (p.bug != 1 && p.bug != 3) kvq_cp_async_wait_group(1);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < MM_TILE; kk++) acc += as[t & 1][ty][kk] * bs[t & 1][kk][tx];
        if (p.bug != 2) __syncthreads();
    }
    kvq_cp_async_wait_all();
    int row = (int)blockIdx.y * MM_TILE + (int)ty, col = (int)blockIdx.x * MM_TILE + (int)tx;
    if (row < p.m && col < p.n) p.c[(size_t)row * p.n + col] = acc;
}
KVQ_KERNEL_EXPORT(matmul_tiled);
