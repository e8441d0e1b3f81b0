/* What the CUDA built-ins of emu_cuda.h call in the emulator runtime. C linkage, C and C++ compatible. Kernel
 * code reads its thread's indices through two thread-local pointers that the scheduler points at the running
 * fiber's thread and block before it switches to it. */
#ifndef EMU_ABI_H
#define EMU_ABI_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

struct emu_idx3 {
    unsigned x, y, z;
};

struct emu_thread_pub {
    struct emu_idx3 tid; /* threadIdx */
    unsigned linear;     /* x + y*bx + z*bx*by */
    unsigned lane;       /* linear % 32 */
};

struct emu_block_pub {
    struct emu_idx3 bid, bdim, gdim; /* blockIdx, blockDim, gridDim */
    void *dyn_smem;
};

/* initial-exec: a kernel built as a shared object reaches them without a __tls_get_addr call per access */
extern __thread struct emu_thread_pub *emu_self_ __attribute__((tls_model("initial-exec")));
extern __thread struct emu_block_pub *emu_blk_ __attribute__((tls_model("initial-exec")));

/* __syncthreads and its _count/_and/_or forms. Returns the count / and / or of pred over the block. */
enum { EMU_BAR_SYNC = 0, EMU_BAR_COUNT = 1, EMU_BAR_AND = 2, EMU_BAR_OR = 3 };
int emu_barrier(int kind, int pred, const char *file, int line);

/* Warp collectives. Each lane in `mask` passes one request; the result for the calling lane comes back. */
enum {
    EMU_W_SYNC = 0,   /* __syncwarp */
    EMU_W_IDX,        /* __shfl_sync */
    EMU_W_UP,         /* __shfl_up_sync */
    EMU_W_DOWN,       /* __shfl_down_sync */
    EMU_W_XOR,        /* __shfl_xor_sync */
    EMU_W_BALLOT,     /* __ballot_sync */
    EMU_W_ANY,        /* __any_sync */
    EMU_W_ALL,        /* __all_sync */
    EMU_W_ADD,        /* __reduce_add_sync (32-bit wrap-around) */
    EMU_W_MIN_U,      /* __reduce_min_sync (unsigned) */
    EMU_W_MAX_U,      /* __reduce_max_sync (unsigned) */
    EMU_W_MIN_I,      /* __reduce_min_sync (int) */
    EMU_W_MAX_I,      /* __reduce_max_sync (int) */
    EMU_W_AND,        /* __reduce_and_sync */
    EMU_W_OR,         /* __reduce_or_sync */
    EMU_W_XOR_R,      /* __reduce_xor_sync */
    EMU_W_MATCH_ANY,  /* __match_any_sync */
    EMU_W_MATCH_ALL,  /* __match_all_sync: result = mask or 0 */
    EMU_W_MMA,        /* mma.sync.m16n8k16.row.col.f32.f16.f16.f32: value points to the lane's emu_mma_frag */
    EMU_W_NOPS
};
struct emu_warp_req {
    int op;
    unsigned mask;
    unsigned long long value; /* the lane's operand, zero-extended bits */
    unsigned size;            /* bytes of the operand type (shuffles of different widths must not meet) */
    int arg;                  /* srcLane / delta / laneMask */
    int width;                /* shuffle segment width */
    const char *file;
    int line;
};
unsigned long long emu_warp(const struct emu_warp_req *r);

/* One lane's operands of mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 (PTX ISA, "Matrix fragments for
 * mma.m16n8k16 with floating point type"): a[4] and b[2] are f16x2 registers (low half first), c the lane's four
 * accumulators; the collective writes d. With g = lane / 4 and t = lane % 4:
 *   a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1], a[2] = A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9]
 *   b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g]
 *   c[0], c[1] = C[g][2t, 2t+1], c[2], c[3] = C[g+8][2t, 2t+1]  (d likewise)
 * Each D element is C plus the 16 products A[i][k] B[k][j], each exact in fp32 (two 11-bit significands), added
 * to it one at a time in fp32, k = 0 .. 15, round to nearest even. */
struct emu_mma_frag {
    unsigned a[4], b[2];
    float c[4], d[4];
};

/* cp.async: copies `size` (4, 8, 16) bytes, of which the first src_size come from src and the rest are zero.
 * The bytes are read at issue and land in dst only at the cp.async.wait that covers their group; until then dst
 * holds 0xff bytes. */
void emu_cp_async(void *dst, const void *src, unsigned size, unsigned src_size, const char *file, int line);
void emu_cp_async_commit(void);
void emu_cp_async_wait(int n); /* cp.async.wait_group n; n < 0: wait_all (commits the open group first) */

__attribute__((noreturn)) void emu_trap(const char *file, int line);

#ifdef __cplusplus
}
#endif

#endif
