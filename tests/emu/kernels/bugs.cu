/* Deliberately broken kernels, for the emulator's tests: each mode is a bug the emulator must report (or, for a
 * race, expose through the shuffled mode) instead of hanging or computing quietly. Mode 0 is the correct
 * kernel the others are variations of. */
#include "kvq_intrin.cuh"
#include "params.h"

enum {
    OK = 0,            /* neighbour exchange through shared memory, with its barrier */
    RACE = 1,          /* the same without the barrier */
    TWO_BARRIERS = 2,  /* warps 0 and 1 wait at different __syncthreads */
    EXIT_EARLY = 3,    /* thread 5 returns, the others wait for it */
    LOOP_TRIPS = 4,    /* a barrier inside a loop whose trip count depends on the thread */
    NOT_IN_MASK = 5,   /* a lane shuffles with a mask that leaves it out */
    MISSING_LANES = 6, /* full mask in a warp the block fills only partly */
    LANE_EXITED = 7,   /* lane 3 returns before a full-mask shuffle */
    DISAGREE = 8,      /* half a warp at __ballot_sync, the other half at __shfl_sync */
    TRAP = 9,          /* block 2, thread 7 calls __trap() */
    MISALIGNED = 10,   /* a 16-byte cp.async to an address 4 bytes off */
    BAR_VS_WARP = 11,  /* half a warp at __syncthreads, the other half at __syncwarp */
    OUTSIDE_MASK = 12, /* shuffle from a lane outside the mask: undefined, all-ones here (not an error) */
    BAD_WIDTH = 13,    /* shuffle width 3 */
    LATE_BLOCK = 14,   /* TWO_BARRIERS, but only in block 1 */
    MMA_PARTIAL = 15,  /* kvq_mma_m16n8k16 in a warp the block fills only partly */
    MMA_HALF = 16      /* half a warp at kvq_mma_m16n8k16, the other half at __shfl_sync */
};

extern "C" __global__ void bug(const struct bug_params p)
{
    __shared__ int s[1024];
    __shared__ __align__(16) float stage[8];
    unsigned tid = threadIdx.x, n = blockDim.x, lane = tid % 32;
    int v = (int)(tid * 7 + 1);
    switch (p.mode) {
    case OK:
    case RACE:
        s[tid] = v;
        if (p.mode == OK) __syncthreads();
        v += s[(tid + 1) % n];
        break;
    case TWO_BARRIERS:
        if (tid < 32)
            __syncthreads();
        else
            __syncthreads();
        break;
    case EXIT_EARLY:
        if (tid == 5) return;
        __syncthreads();
        break;
    case LOOP_TRIPS:
        for (unsigned i = 0; i < tid % 3; i++) __syncthreads();
        break;
    case NOT_IN_MASK:
        v = __shfl_sync(1u, v, 0);
        break;
    case MISSING_LANES:
        v = __shfl_xor_sync(0xffffffffu, v, 1);
        break;
    case LANE_EXITED:
        if (lane == 3) return;
        v = __shfl_sync(0xffffffffu, v, 0);
        break;
    case DISAGREE:
        if (lane < 16)
            v = (int)__ballot_sync(0xffffffffu, v & 1);
        else
            v = __shfl_sync(0xffffffffu, v, 0);
        break;
    case TRAP:
        if (blockIdx.x == 2 && tid == 7) __trap();
        break;
    case MISALIGNED: {
        const float *src = reinterpret_cast<const float *>(p.out);
        if (tid == 0) kvq_cp_async16(&stage[1], src);
        kvq_cp_async_wait_all();
        break;
    }
    case BAR_VS_WARP:
        if (lane < 16)
            __syncthreads();
        else
            __syncwarp();
        break;
    case OUTSIDE_MASK:
        if (lane < 16) v = __shfl_sync(0x0000ffffu, v, 20);
        break;
    case BAD_WIDTH:
        v = __shfl_sync(0xffffffffu, v, 0, 3);
        break;
    case MMA_PARTIAL:
    case MMA_HALF: {
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const unsigned a[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u}, b[2] = {0x3c003c00u, 0x3c003c00u};
        if (p.mode == MMA_HALF && lane >= 16)
            v = __shfl_sync(0xffffffffu, v, 0);
        else
            kvq_mma_m16n8k16(acc, a, b), v = (int)acc[0];
        break;
    }
    case LATE_BLOCK:
        if (blockIdx.x == 1 && tid >= 32)
            __syncthreads();
        else
            __syncthreads();
        break;
    }
    p.out[blockIdx.x * n + tid] = v;
}
KVQ_KERNEL_EXPORT(bug);
